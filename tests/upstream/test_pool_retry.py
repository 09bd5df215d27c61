"""The fast transport's pool against servers that close connections on their own schedule:
a request on a reused connection that fails before any response byte is sent once more on a
fresh one; on a fresh connection, or after a byte, never. Idle expiry follows the server's
`Keep-Alive: timeout=N` hint. Raw asyncio servers script every byte
(tests/upstream/test_transport.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from proxy.upstream.connection import Connection
from proxy.upstream.reuse import HINT_CAP, RESEND_WITHIN, keep_alive_expiry
from proxy.upstream.transport import Transport
from tests.conftest import ProxyFactory
from tests.sse_client import chat_body
from tests.stress import harness
from tests.upstream.test_transport import Server, client, content_length_response, serve

CHAT = "/v1/chat/completions"
ServerHandler = Callable[[Server, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def closes_the_second_request_on_its_first_connection(answer_then: bytes = b"") -> ServerHandler:
    """A server that answers the first request of its first connection keep-alive, then
    reads the next request on it and closes (after `answer_then`, if any) without a
    response: the race of a pooled connection reused just as the server expires it."""

    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        first_connection = server.connections == 1
        n = 0
        while await server.read_request(r) is not None:
            n += 1
            if first_connection and n == 2:
                w.write(answer_then)
                await w.drain()
                return  # Server._handle closes the socket
            w.write(content_length_response(b"ok%d" % len(server.requests)))
            await w.drain()

    return handler


async def test_a_reused_connection_closed_before_any_byte_is_retried_on_a_fresh_one() -> None:
    transport = Transport()
    async with serve(closes_the_second_request_on_its_first_connection()) as server:
        async with client(transport) as c:
            first = await c.post(server.url + "/a", content=b"one")
            second = await c.post(server.url + "/b", content=b"two")
    assert (first.content, second.content) == (b"ok1", b"ok3")
    assert server.connections == 2
    # The second request went twice: once on the closed connection, once on the new one.
    assert [req.split(b" ")[1] for req in server.requests] == [b"/a", b"/b", b"/b"]
    assert server.requests[1].endswith(b"two") and server.requests[2].endswith(b"two")


async def test_a_fresh_connection_is_never_retried() -> None:
    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await server.read_request(r)  # and close without a word

    async with serve(handler) as server, client(Transport()) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.post(server.url, content=b"x")
    assert server.connections == 1 and len(server.requests) == 1


async def test_a_reused_connection_that_sent_a_byte_is_not_retried() -> None:
    handler = closes_the_second_request_on_its_first_connection(b"HTTP/1.1 200 OK\r\n")
    async with serve(handler) as server, client(Transport()) as c:
        assert (await c.post(server.url, content=b"1")).content == b"ok1"
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            await c.post(server.url, content=b"2")
    assert server.connections == 1 and len(server.requests) == 2
    # The connection's own error, as it was: not raised from itself, a chain that loops
    # (the proxy's status page once walked such a chain for ever, its loop blocked).
    assert caught.value.__cause__ is None


async def test_a_body_that_cannot_be_sent_again_is_not_retried_after_the_race() -> None:
    """The stale keep-alive race, but the request's body was a stream, read as it was
    sent: it cannot go again. The error is the connection's, with no word of a server that
    held the request (it closed at once)."""

    async def parts() -> AsyncIterator[bytes]:
        yield b"streamed"

    async with serve(closes_the_second_request_on_its_first_connection()) as server:
        async with client(Transport()) as c:
            assert (await c.post(server.url, content=b"1")).content == b"ok1"
            with pytest.raises(httpx.RemoteProtocolError) as caught:
                await c.post(server.url, content=parts())
    assert server.connections == 1 and len(server.requests) == 2
    assert server.requests[1].endswith(b"streamed")
    said = str(caught.value)
    assert "not sent again" not in said and "took the request" not in said
    assert caught.value.__cause__ is None


async def test_the_race_is_judged_by_when_the_connection_ended_not_by_when_it_is_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A busy loop: the step that sees the server close the reused connection takes longer
    than RESEND_WITHIN before the request's own task runs again. The server closed at once,
    so the request still goes once more; the time the loop was busy is not the server's."""
    lost = Connection.connection_lost
    busy: list[float] = []

    def lost_then_busy(self: Connection, exc: Exception | None) -> None:
        waiting = self.reused and self.started is not None and not self.started.done()
        lost(self, exc)
        if waiting:  # the request on the reused connection has not seen the close yet
            time.sleep(3 * RESEND_WITHIN)  # the loop, busy with other work, blocks
            busy.append(time.monotonic())

    monkeypatch.setattr(Connection, "connection_lost", lost_then_busy)
    async with serve(closes_the_second_request_on_its_first_connection()) as server:
        async with client(Transport()) as c:
            first = await c.post(server.url + "/a", content=b"one")
            second = await c.post(server.url + "/b", content=b"two")
    assert len(busy) == 1, "the reused connection's close was not seen while its request waited"
    assert (first.content, second.content) == (b"ok1", b"ok3")
    assert [req.split(b" ")[1] for req in server.requests] == [b"/a", b"/b", b"/b"]


async def test_a_read_timeout_on_a_reused_connection_is_not_retried() -> None:
    quiet = asyncio.Event()

    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await server.read_request(r)
        w.write(content_length_response(b"ok"))
        await w.drain()
        await server.read_request(r)
        await quiet.wait()  # the upstream is thinking: asking again could double the work

    async with serve(handler) as server, client(Transport()) as c:
        assert (await c.get(server.url)).content == b"ok"
        with pytest.raises(httpx.ReadTimeout):
            await c.get(server.url, timeout=httpx.Timeout(5, read=0.2))
        quiet.set()
    assert server.connections == 1 and len(server.requests) == 2


def holds_every_request_but_the_first(seconds: float) -> ServerHandler:
    """A provider that answers its first request (keep-alive), then takes every later one,
    on any connection, says nothing for `seconds` and drops the connection: it may have
    worked on the request (and billed it) all that time."""

    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await server.read_request(r) is not None:
            if len(server.requests) > 1:
                await asyncio.sleep(seconds)
                return  # Server._handle closes the socket: no response, no byte
            w.write(content_length_response(b"ok"))
            await w.drain()

    return handler


async def test_a_request_the_server_held_before_closing_is_never_sent_again() -> None:
    """Not the stale keep-alive race: the server read the request and held it (longer than
    RESEND_WITHIN) before it closed. Sent once; the failure says so."""
    async with serve(holds_every_request_but_the_first(0.5)) as server:
        async with client(Transport()) as c:
            assert (await c.post(server.url, content=b"1")).content == b"ok"
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(httpx.RemoteProtocolError, match="not sent again"):
                await c.post(server.url, content=b"2")
            waited = loop.time() - start
    assert server.connections == 1 and len(server.requests) == 2  # asked once
    assert 0.5 <= waited < 1.0


async def test_through_the_proxy_a_held_then_dropped_request_is_a_502_asked_once(
    make_proxy: ProxyFactory,
) -> None:
    """Issue 27: a provider silent for 3 s after taking the request on a reused connection,
    then closing. Directly the client gets its error after 3 s; through the proxy too, a 502
    naming the cause, and the provider was asked once (a resend had it work twice and the
    caller wait 6 s for the same failure)."""
    async with serve(holds_every_request_but_the_first(3.0)) as server:
        async with make_proxy(server.url) as p, p.client() as c:
            harness.watch(p.runtime)
            body = chat_body(stream=False) | {"stream": False}
            assert (await c.post(CHAT, json=body)).status_code == 200
            loop = asyncio.get_running_loop()
            start = loop.time()
            held = await c.post(CHAT, json=body)
            waited = loop.time() - start
            records = await harness.settled(p.runtime, 2)
    assert held.status_code == 502
    assert held.json()["error"]["code"] == "upstream_error"
    assert len(server.requests) == 2 and server.connections == 1  # asked once
    assert 3.0 <= waited < 4.5
    assert "not sent again" in records[-1].cause


async def test_through_the_proxy_the_client_never_sees_the_race(make_proxy: ProxyFactory) -> None:
    """What the retry is for: before it, the second request got a 502."""
    async with serve(closes_the_second_request_on_its_first_connection()) as server:
        async with make_proxy(server.url) as p, p.client() as c:
            body = chat_body(stream=False) | {"stream": False}
            statuses = [(await c.post(CHAT, json=body)).status_code for _ in range(2)]
    assert statuses == [200, 200] and server.connections == 2


# --- the Keep-Alive hint -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expiry"),
    [
        (b"timeout=5", 4.0),
        (b"timeout=5, max=100", 4.0),
        (b"max=100, Timeout=15", 14.0),
        (b"timeout=1", 0.0),
        (b"timeout=0", 0.0),
        (b"timeout=3600", HINT_CAP),
        (b"timeout=nope", 4.0),
        (b"timeout=nan", 4.0),
        (b"max=5", 4.0),
    ],
)
def test_keep_alive_hint(value: bytes, expiry: float) -> None:
    assert keep_alive_expiry(value, 4.0) == expiry


def server_with_hint(hint: bytes) -> ServerHandler:
    async def handler(server: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await server.read_request(r) is not None:
            w.write(content_length_response(b"ok", b"Keep-Alive: " + hint + b"\r\n"))
            await w.drain()

    return handler


@pytest.mark.parametrize(("hint", "connections"), [(b"timeout=1", 2), (b"timeout=30", 1)])
async def test_idle_connections_follow_the_servers_hint(hint: bytes, connections: int) -> None:
    # timeout=1 leaves no safe time to reuse it; timeout=30 outlives the default expiry of 0.
    transport = Transport(keepalive_expiry=0.0)
    async with serve(server_with_hint(hint)) as server, client(transport) as c:
        for _ in range(2):
            assert (await c.get(server.url)).content == b"ok"
    assert server.connections == connections
