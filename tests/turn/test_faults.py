"""Faults an upstream or a client can produce, each survived: a clear error in the caller's
dialect, the upstream closed, the registry and the active set empty, never a crash.

Everything stays on 127.0.0.1, except one DNS lookup of a name in the reserved `.invalid`
TLD (RFC 6761: it never resolves), which goes to the machine's configured resolver.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from proxy.ops.record import Record
from tests.conftest import Proxy, ProxyFactory
from tests.scripted import Script, ScriptedUpstream, Seen, free_port
from tests.sse_client import chat_body, events, events_of_a_cut_body
from tests.stress import harness

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


# --- helpers -------------------------------------------------------------------------


@pytest.fixture
def make_proxy(make_proxy: ProxyFactory) -> ProxyFactory:
    """conftest's, with a FinishWatch attached before the first request."""

    @asynccontextmanager
    async def start(upstream_url: str, **overrides: Any) -> AsyncIterator[Proxy]:
        async with make_proxy(upstream_url, **overrides) as p:
            harness.watch(p.runtime)
            yield p

    return start


async def settled(proxy: Proxy, requests: int = 1) -> list[Record]:
    """Once `requests` requests have finished: nothing left behind."""
    return await harness.settled(proxy.runtime, requests)


@asynccontextmanager
async def raw_server(answer: bytes) -> AsyncIterator[str]:
    """A TCP server on loopback that reads a request head and answers `answer`, then closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def wait_quiet(seen: Seen, quiet: float = 0.4, deadline: float = 15.0) -> int:
    """Until the upstream has sent nothing for `quiet` seconds; its event count then.
    (Only a stretch of time can show that something stopped happening.)"""
    async with asyncio.timeout(deadline):
        while True:
            before = seen.events_sent
            seen.sent_event.clear()
            try:
                async with asyncio.timeout(quiet):
                    await seen.sent_event.wait()
            except TimeoutError:
                if seen.events_sent == before:
                    return before


# --- upstream faults -----------------------------------------------------------------


@pytest.mark.parametrize(("path", "shape"), [(CHAT, "openai"), (MESSAGES, "anthropic")])
async def test_connection_refused_is_502_in_the_callers_dialect(
    make_proxy: ProxyFactory, path: str, shape: str
) -> None:
    async with make_proxy(f"http://127.0.0.1:{free_port()}") as p, p.client() as client:
        r = await client.post(path, json=chat_body(), headers={"X-Turn-Id": "t"})
        await settled(p)
    assert r.status_code == 502
    body = r.json()
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "upstream_unreachable"
    else:
        assert body["error"]["code"] == "upstream_unreachable"
    assert r.headers.get("x-should-retry") != "false"  # a retry may well succeed


async def test_dns_failure_is_502_and_fast(make_proxy: ProxyFactory) -> None:
    loop = asyncio.get_running_loop()
    async with (
        make_proxy("http://nonexistent.invalid:8080", **{"upstream.connect_timeout": 5}) as p,
        p.client() as client,
    ):
        start = loop.time()
        r = await client.post(CHAT, json=chat_body(), headers={"X-Turn-Id": "dns"})
        elapsed = loop.time() - start
        await settled(p)
    assert r.status_code in (502, 504)
    assert r.json()["error"]["code"] in ("upstream_unreachable", "upstream_timeout")
    assert elapsed < 5.5


async def test_tls_to_a_plain_http_port_is_a_502(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    port = urlsplit(upstream.url).port
    async with make_proxy(f"https://127.0.0.1:{port}") as p, p.client() as client:
        r = await client.post(CHAT, json=chat_body(), headers={"X-Turn-Id": "tls"})
        await settled(p)
    assert r.status_code == 502
    assert r.json()["error"]["code"] in ("upstream_unreachable", "upstream_error")
    assert upstream.seen == []  # a TLS hello is not an HTTP request


@pytest.mark.parametrize(
    "answer",
    [
        b"garbage garbage garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n",
        b"",  # closes without a word
    ],
)
async def test_upstream_answering_garbage_is_a_502(make_proxy: ProxyFactory, answer: bytes) -> None:
    async with raw_server(answer) as url, make_proxy(url) as p, p.client() as client:
        r = await client.post(CHAT, json=chat_body(), headers={"X-Turn-Id": "g"})
        await settled(p)
    assert r.status_code == 502
    assert r.json()["error"]["code"] in ("upstream_error", "upstream_unreachable")
    assert r.headers.get("x-should-retry") != "false"


@pytest.mark.parametrize("status", [400, 401, 404, 429, 500, 503])
async def test_upstream_error_status_and_body_pass_unchanged(
    proxy: Proxy, upstream: ScriptedUpstream, status: int
) -> None:
    async with proxy.client() as client:
        r = await client.post(CHAT, json=chat_body(status=status), headers={"X-Turn-Id": "e"})
    assert r.status_code == status
    assert r.json() == {"error": {"message": "scripted failure", "type": "scripted"}}
    assert r.headers["content-type"] == "application/json"
    await settled(proxy)


async def test_stream_broken_mid_way_ends_with_an_error_event(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    async with proxy.client() as client:
        async with client.stream(
            "POST", CHAT, json=chat_body(tokens=5, fail_after=2), headers={"X-Turn-Id": "b"}
        ) as r:
            got = await events_of_a_cut_body(r)  # cut downstream too, after the error
        await settled(proxy)
    assert [e.text for e in got[:2]] == ["0 ", "1 "]
    assert len(got) == 3
    assert got[-1].json["error"]["code"] == "upstream_error"
    assert list(got[-1].json) == ["error"]
    assert not any(e.data == "[DONE]" for e in got)


async def test_stream_broken_before_its_first_event_ends_with_an_error_event(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    # Its headers went out, no event after them: the error event is all the body has.
    async with proxy.client() as client:
        async with client.stream("POST", CHAT, json=chat_body(tokens=5, fail_after=0)) as r:
            assert r.status_code == 200
            got = await events_of_a_cut_body(r)
        (record,) = await settled(proxy)
    assert [e.json["error"]["code"] for e in got] == ["upstream_error"]
    assert record.outcome == "upstream_error" and record.events == 0


async def test_stream_stalled_past_the_idle_timeout_ends_with_an_error_event(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(upstream.url, **{"upstream.idle_timeout": 0.3}) as p:
        async with p.client() as client:
            async with client.stream(
                "POST", MESSAGES, json=chat_body(gated=True), headers={"X-Turn-Id": "s"}
            ) as r:
                got = await events_of_a_cut_body(r)
            seen = upstream.seen[0]
            await asyncio.wait_for(seen.closed.wait(), 5)  # closed by the proxy, not drained
            await settled(p)
    assert seen.events_sent == 1
    assert got[0].event == "message_start"
    assert got[-1].event == "error"
    assert got[-1].json == {
        "type": "error",
        "error": {"type": "upstream_timeout", "message": got[-1].json["error"]["message"]},
    }


async def test_upstream_silent_before_headers_past_the_idle_timeout_is_504(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(upstream.url, **{"upstream.idle_timeout": 0.3}) as p:
        async with p.client() as client:
            r = await client.post(CHAT, json=chat_body(hold_headers=True))
            await asyncio.wait_for(upstream.seen[0].closed.wait(), 5)
            await settled(p)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"


async def test_event_over_the_size_limit_ends_the_stream_with_an_error(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    good = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
    huge = b"data: " + b"x" * 5000  # no terminator yet: the splitter must not keep growing
    upstream.default = Script(raw_bytes=[good, huge, huge, b"\n\n", good], stream=True)
    async with make_proxy(upstream.url, **{"upstream.max_event_bytes": 4096}) as p:
        async with p.client() as client:
            async with client.stream("POST", CHAT, content=b"not json") as r:
                got = await events_of_a_cut_body(r)
            await settled(p)
    assert [e.text for e in got[:1]] == ["ok"]
    assert len(got) == 2
    assert got[-1].json["error"]["code"] == "malformed_stream"


async def test_invalid_utf8_ends_the_stream_with_an_error_and_closes_the_upstream(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    good = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
    bad = b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe"}}]}\n\n'
    upstream.default = Script(raw_bytes=[good, bad, good, good], gated=True, stream=True)
    async with make_proxy(upstream.url) as p:
        async with p.client() as client:
            async with client.stream("POST", CHAT, content=b"raw") as r:
                it = events(r)
                first = await anext(it)
                seen = upstream.seen[0]
                seen.release(1)  # the bad event; the upstream then waits on its gate
                rest = []
                with pytest.raises(httpx.RemoteProtocolError):  # cut after the error
                    async for e in it:
                        rest.append(e)
            await asyncio.wait_for(seen.closed.wait(), 5)
            await settled(p)
    assert first.text == "ok"
    assert [e.json["error"]["code"] for e in rest] == ["malformed_stream"]
    assert seen.events_sent == 2


async def test_slow_first_byte_is_still_delivered(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(upstream.url, **{"upstream.idle_timeout": 5}) as p:
        async with p.client() as client:
            task = asyncio.create_task(
                client.post(CHAT, json=chat_body(hold_headers=True, stream=False))
            )
            seen = (await upstream.wait_requests(1))[0]
            await asyncio.sleep(0.8)  # the fault itself: a slow upstream, not synchronisation
            assert not task.done()
            seen.release()
            r = await task
            await settled(p)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "0 1 2 "


# --- client faults -------------------------------------------------------------------


async def test_client_leaving_while_the_body_is_read_forwards_nothing(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    host, port = urlsplit(proxy.url).hostname, urlsplit(proxy.url).port
    _, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Turn-Id: half\r\n"
        b"content-length: 1000\r\n\r\n" + b"{" * 10
    )
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    [record] = await settled(proxy)
    assert record.outcome == "client_gone"
    assert upstream.seen == []


async def test_client_leaving_before_headers_and_mid_stream_leaves_nothing(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    async with proxy.client() as client:
        task = asyncio.create_task(
            client.post(CHAT, json=chat_body(hold_headers=True), headers={"X-Turn-Id": "l1"})
        )
        before = (await upstream.wait_requests(1))[0]
        task.cancel()
        await asyncio.wait_for(before.closed.wait(), 5)
        async with client.stream(
            "POST", CHAT, json=chat_body(gated=True, tokens=20), headers={"X-Turn-Id": "l2"}
        ) as r:
            await anext(events(r))
        mid = upstream.seen[1]
        await asyncio.wait_for(mid.closed.wait(), 5)
    assert before.events_sent == 0 and mid.events_sent == 1
    records = await settled(proxy, 2)
    assert [r.outcome for r in records] == ["client_gone", "client_gone"]


EVENT_SIZE = 64 * 1024
EVENTS = 2000  # 128 MiB if nothing held the upstream back


def big_stream() -> Script:
    pad = b"x" * (EVENT_SIZE - 32)
    return Script(
        raw_bytes=[b"data: %08d " % i + pad + b"\n\n" for i in range(EVENTS)], stream=True
    )


class SlowClient:
    """A raw-socket client with a small receive buffer, so that what it does not read
    stays in the proxy's hands rather than in the kernel on the client's side."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.received = 0

    @classmethod
    async def open(cls, url: str, path: str, headers: dict[str, str]) -> SlowClient:
        parts = urlsplit(url)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=16 * 1024)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\ncontent-length: 4\r\n"
            f"{head}\r\nnope".encode()
        )
        await writer.drain()
        client = cls(reader, writer)
        head_bytes = await reader.readuntil(b"\r\n\r\n")
        assert head_bytes.startswith(b"HTTP/1.1 200"), head_bytes
        return client

    async def read_all(self) -> bytes:
        data = await self.reader.read()
        self.received += len(data)
        return data

    def close(self) -> None:
        self.writer.close()


async def test_slow_reader_throttles_the_upstream_and_then_gets_everything(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    upstream.default = big_stream()
    async with make_proxy(upstream.url, **{"server.write_timeout": 0}) as p:
        client = await SlowClient.open(p.url, CHAT, {"X-Turn-Id": "slow"})
        seen = (await upstream.wait_requests(1))[0]
        sent = await wait_quiet(seen)
        # Flow control: while the client does not read, the proxy stops reading the
        # upstream, whose own writes then block. What sits between them is bounded by
        # socket buffers, not by the length of the stream.
        held = sent * EVENT_SIZE
        assert held < 48 * 1024 * 1024, held
        assert sent < EVENTS // 2
        assert not seen.finished
        body = await client.read_all()
        client.close()
        await settled(p)
    assert seen.finished and seen.events_sent == EVENTS
    # All of it, in order: nothing dropped or reordered by the pause.
    numbers = [int(body[i + 6 : i + 14]) for i in _find_all(body, b"data: ")]
    assert numbers == list(range(EVENTS))
    print(
        f"\nslow reader: upstream paused after {held / 2**20:.1f} MiB of {EVENTS * 64 / 1024} MiB"
    )


def _find_all(body: bytes, needle: bytes) -> list[int]:
    out, i = [], body.find(needle)
    while i >= 0:
        out.append(i)
        i = body.find(needle, i + 1)
    return out


async def test_client_that_blocks_a_write_past_write_timeout_is_dropped(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="streamfence")
    upstream.default = big_stream()
    async with make_proxy(upstream.url, **{"server.write_timeout": 0.5}) as p:
        client = await SlowClient.open(p.url, CHAT, {"X-Turn-Id": "stuck"})
        seen = (await upstream.wait_requests(1))[0]
        await asyncio.wait_for(seen.closed.wait(), 10)  # dropped: its upstream closed
        assert not seen.finished
        [record] = await settled(p)
        assert (record.outcome, record.error) == ("client_gone", "client_write_timeout")
        # What the client can still read ends without a terminator: the stream was cut.
        async with asyncio.timeout(10):
            body = await client.read_all()
        client.close()
    assert b"[DONE]" not in body
    records = [json.loads(r.getMessage()) for r in caplog.records if '"request"' in r.getMessage()]
    assert [(r["outcome"], r["error"]) for r in records] == [
        ("client_gone", "client_write_timeout")
    ]


async def test_client_leaving_while_the_proxy_is_blocked_writing_to_it(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    upstream.default = big_stream()
    async with make_proxy(upstream.url, **{"server.write_timeout": 0}) as p:
        client = await SlowClient.open(p.url, CHAT, {"X-Turn-Id": "gone"})
        seen = (await upstream.wait_requests(1))[0]
        await wait_quiet(seen)  # the proxy is now blocked writing to the client
        client.writer.transport.abort()  # RST, with unread data in its buffer
        await asyncio.wait_for(seen.closed.wait(), 10)
        [record] = await settled(p)
        assert record.outcome == "client_gone"
    assert not seen.finished


# --- the proxy itself: SIGTERM ---------------------------------------------------------


@asynccontextmanager
async def proxy_process(upstream_url: str, grace: float) -> AsyncIterator[tuple[Any, str]]:
    """`python -m proxy` as a real process on a free loopback port."""
    port = free_port()
    env = {**os.environ, "STREAMFENCE_SERVER_SHUTDOWN_GRACE": str(grace)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        "--upstream",
        upstream_url,
        "--port",
        str(port),
        "--log-level",
        "warning",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url) as probe, asyncio.timeout(20):
            for _ in range(2000):
                try:
                    if (await probe.get("/_streamfence/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.02)  # the process is still starting
        yield proc, url
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def refused(url: str) -> bool:
    """Whether a new connection to `url` is refused (or closed before any answer)."""
    async with httpx.AsyncClient(base_url=url, timeout=2) as c:
        try:
            await c.get("/_streamfence/healthz")
        except httpx.TransportError:
            return True
    return False


async def test_sigterm_stops_accepting_and_lets_running_streams_finish(
    upstream: ScriptedUpstream,
) -> None:
    loop = asyncio.get_running_loop()
    async with proxy_process(upstream.url, grace=20) as (proc, url):
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            async with client.stream(
                "POST", CHAT, json=chat_body(gated=True, tokens=4), headers={"X-Turn-Id": "t"}
            ) as r:
                it = events(r)
                assert (await anext(it)).text == "0 "
                proc.send_signal(signal.SIGTERM)
                signalled = loop.time()
                async with asyncio.timeout(5):
                    while not await refused(url):  # uvicorn closes its listener within ~0.1 s
                        pass
                upstream.seen[0].release(10)
                rest = [e async for e in it]
        code = await asyncio.wait_for(proc.wait(), 15)
        stderr = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
    assert "".join(e.text for e in rest) == "1 2 3 "
    assert rest[-1].data == "[DONE]"
    assert code == 0, stderr
    assert loop.time() - signalled < 10  # it did not wait out the grace period
    assert "Traceback" not in stderr


async def test_sigterm_ends_streams_still_running_after_the_grace_with_an_error_event(
    upstream: ScriptedUpstream,
) -> None:
    loop = asyncio.get_running_loop()
    async with proxy_process(upstream.url, grace=0.5) as (proc, url):
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            waiting = asyncio.create_task(
                client.post(MESSAGES, json=chat_body(hold_headers=True), headers={"X-Turn-Id": "w"})
            )
            async with client.stream(
                "POST", CHAT, json=chat_body(gated=True, tokens=9), headers={"X-Turn-Id": "s"}
            ) as r:
                it = events(r)
                await anext(it)
                await upstream.wait_requests(2)
                proc.send_signal(signal.SIGTERM)
                signalled = loop.time()
                rest = [e async for e in it]
            before_headers = await waiting
        code = await asyncio.wait_for(proc.wait(), 15)
        stderr = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
    for seen in upstream.seen:
        await asyncio.wait_for(seen.closed.wait(), 5)  # closed, not drained
    # Mid-stream: one error event in the stream's dialect, never a success terminator.
    assert [e.json["error"]["code"] for e in rest] == ["shutting_down"]
    assert list(rest[0].json) == ["error"]
    # Before headers: a 503 in the caller's dialect (Anthropic, for /v1/messages).
    assert before_headers.status_code == 503
    assert before_headers.json()["error"]["type"] == "shutting_down"
    assert code == 0, stderr
    assert 0.4 < loop.time() - signalled < 3.5
    assert "Traceback" not in stderr


async def test_client_that_stops_reading_at_the_very_end_is_still_dropped(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    # One event larger than every buffer on the way: the proxy's write of it leaves the
    # transport over its high-water mark, so the write that blocks is the response's last
    # (the empty end-of-body), after the upstream has already finished.
    upstream.default = Script(raw_bytes=[b"data: " + b"x" * (12 << 20) + b"\n\n"], stream=True)
    async with make_proxy(upstream.url, **{"server.write_timeout": 0.5}) as p:
        client = await SlowClient.open(p.url, CHAT, {"X-Turn-Id": "end"})
        [record] = await settled(p)
        client.close()
    assert upstream.seen[0].finished
    assert (record.outcome, record.error) == ("client_gone", "client_write_timeout")


@pytest.mark.parametrize(
    ("path", "last"),
    [
        ("/v1/chat/completions", "data: [DONE]\n\n"),
        ("/v1/messages", 'event: message_stop\ndata: {"type":"message_stop"}\n\n'),
        ("/v1/responses", 'event: response.completed\ndata: {"type":"response.completed"}\n\n'),
    ],
)
async def test_a_client_that_leaves_right_after_the_terminator_completed(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, path: str, last: str
) -> None:
    """hermes-agent closes its connection as soon as it reads `[DONE]`, while the upstream
    has not ended its body yet: the answer was delivered, so the outcome is `completed`."""
    upstream.default = Script(
        stream=True, gated=True, raw=['data: {"a":1}\n\n', last, ": tail\n\n"]
    )
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        async with client.stream("POST", path, json={"stream": True}) as response:
            upstream.seen[0].release(1)  # the terminator, but not the body's end
            stream = events(response)
            received = [await anext(stream), await anext(stream)]
        # The first event and the terminator, and then the client left.
        assert received[0].data == '{"a":1}' and received[1].data in last
        (record,) = await settled(proxy)
    assert record.outcome == "completed"
    assert not upstream.seen[0].finished  # the upstream had not ended its body


@pytest.mark.parametrize(
    ("path", "last"),
    [
        ("/v1/chat/completions", "data: [DONE]\n\n"),
        ("/v1/messages", 'event: message_stop\ndata: {"type":"message_stop"}\n\n'),
        ("/v1/responses", 'event: response.completed\ndata: {"type":"response.completed"}\n\n'),
    ],
)
async def test_an_upstream_that_breaks_its_body_after_the_terminator_delivered_the_answer(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, path: str, last: str
) -> None:
    """The upstream sent its terminator and then broke its chunked body instead of ending
    it: the client has the whole answer, and is not told of a failure after it (an error
    event after `[DONE]` is one the SDKs raise on, over an answer they already returned)."""
    upstream.default = Script(
        stream=True, raw=['data: {"a":1}\n\n', last, ": tail\n\n"], fail_after=2
    )
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        async with client.stream("POST", path, json={"stream": True}) as response:
            body = await response.aread()
        (record,) = await settled(proxy)
    assert upstream.seen[0].broke
    assert body == ('data: {"a":1}\n\n' + last).encode()
    assert record.outcome == "completed" and not record.error
