"""A body the upstream cut mid-way is cut downstream too (CONTRACT section 5; issue 27 item 4).

The client gets the events that came, the dialect's error event (so that the SDKs raise with
the cause), and then a body without its terminator, as it would directly: curl exits 18,
httpx raises RemoteProtocolError. An answer already whole before the break ends cleanly, and
so does the superseded frame (CONTRACT section 4).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from proxy.server import eager
from tests.conftest import ProxyFactory
from tests.scripted import Script, ScriptedUpstream
from tests.sse_client import chat_body, events, events_of_a_cut_body
from tests.stress import harness

CHAT = "/v1/chat/completions"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_upstream(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


def answers_then_drops(head: bytes, *chunks: bytes) -> Handler:
    """Reads the request, writes `head` and each chunk (chunked framing), then closes the
    connection without the last chunk: a provider dying mid-body."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head)
        for chunk in chunks:
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.close()

    return handler


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"t%d "}}]}\n\n'


class Complaints(logging.Handler):
    """What uvicorn logs, at warning or above (it does not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def test_curl_reads_a_cut_stream_as_cut(make_proxy: ProxyFactory) -> None:
    """curl: the tokens, the error event, then exit 18 (a partial transfer), as directly;
    and the server has nothing to complain about (the cut is deliberate: a response left
    unfinished instead would end the same way for curl, with uvicorn's "ASGI callable
    returned without completing response" in the log)."""
    complaints = Complaints()
    handler = answers_then_drops(SSE_HEAD, TOKEN % 0, TOKEN % 1)  # no uvicorn of its own
    async with raw_upstream(handler) as url, make_proxy(url) as p:
        # Once the proxy runs: its start (proxy.ops.logs.configure) clears uvicorn's handlers.
        logging.getLogger("uvicorn.error").addHandler(complaints)
        try:
            harness.watch(p.runtime)
            body = json.dumps(chat_body())
            curl = await asyncio.create_subprocess_exec(
                "curl", "-sN", "-H", "content-type: application/json", "-d", body, p.url + CHAT,
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(curl.communicate(), 20)
            (record,) = await harness.settled(p.runtime, 1)
        finally:
            logging.getLogger("uvicorn.error").removeHandler(complaints)
    assert curl.returncode == 18, out
    datas = [line[5:].strip() for line in out.decode().splitlines() if line.startswith("data:")]
    assert json.loads(datas[-1])["error"]["code"] == "upstream_error"
    assert [json.loads(d)["choices"][0]["delta"]["content"] for d in datas[:-1]] == ["t0 ", "t1 "]
    assert record.outcome == "upstream_error"
    assert complaints.messages == []


@pytest.mark.parametrize(
    ("path", "error_code"),
    [
        pytest.param(CHAT, lambda e: e.json["error"]["code"], id="chat"),
        pytest.param("/v1/responses", lambda e: e.json["code"], id="responses"),
        pytest.param("/v1/messages", lambda e: e.json["error"]["type"], id="anthropic"),
        pytest.param(
            "/v1beta/models/m:streamGenerateContent",
            lambda e: e.json["error"]["status"],
            id="gemini",
        ),
    ],
)
async def test_httpx_reads_a_cut_stream_as_cut_in_every_dialect(
    upstream: ScriptedUpstream,
    make_proxy: ProxyFactory,
    path: str,
    error_code: Callable[..., str],
) -> None:
    upstream.default = Script(tokens=6, fail_after=3)
    async with make_proxy(upstream.url) as p, p.client() as client:
        harness.watch(p.runtime)
        async with client.stream("POST", path, json=chat_body()) as r:
            got = await events_of_a_cut_body(r)  # RemoteProtocolError after the events
        await harness.settled(p.runtime, 1)
    assert got[-1].is_error and len(got) == 4
    assert error_code(got[-1]) in ("upstream_error", "UNAVAILABLE")


async def test_a_json_body_cut_mid_way_is_cut_for_the_client(make_proxy: ProxyFactory) -> None:
    """Not an event stream: no frame fits in it; the body ends unterminated, as directly."""
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    handler = answers_then_drops(head, b'{"id": "x", ', b'"choices": [')
    async with raw_upstream(handler) as url, make_proxy(url) as p, p.client() as client:
        body = b""
        async with client.stream("POST", CHAT, json={"model": "m"}) as r:
            assert r.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                async for chunk in r.aiter_raw():
                    body += chunk
    assert body == b'{"id": "x", "choices": ['


async def test_an_answer_whole_before_the_break_ends_cleanly(make_proxy: ProxyFactory) -> None:
    """`data: [DONE]` came, then the upstream dropped its connection without the last chunk:
    the client has its whole answer, which ends cleanly, with no error event."""
    handler = answers_then_drops(SSE_HEAD, TOKEN % 0, TOKEN % 1, b"data: [DONE]\n\n")
    async with raw_upstream(handler) as url, make_proxy(url) as p, p.client() as client:
        harness.watch(p.runtime)
        async with client.stream("POST", CHAT, json=chat_body()) as r:
            got = [e async for e in events(r)]  # a clean end: nothing raised
        (record,) = await harness.settled(p.runtime, 1)
    assert [e.text for e in got[:2]] == ["t0 ", "t1 "]
    assert got[-1].data == "[DONE]" and not any(e.is_error for e in got)
    assert record.outcome == "completed"


async def test_a_superseded_stream_still_ends_cleanly_after_its_frame(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    """The proxy's own ending is not a cut: the frame, then a terminated body."""
    async with make_proxy(upstream.url) as p, p.client() as client:
        turn = {"X-Turn-Id": "cut-or-not"}
        async with client.stream(
            "POST", CHAT, json=chat_body(gated=True, prefix="A"), headers=turn
        ) as a:
            a_events = events(a)
            assert (await anext(a_events)).text == "A0 "
            b = await client.post(CHAT, json=chat_body(prefix="B"), headers=turn)
            rest = [e async for e in a_events]  # a clean end: nothing raised
    assert b.status_code == 200
    assert [e.json["error"]["code"] for e in rest] == ["stream_superseded"]


def test_the_cut_ends_uvicorns_cycle_only_through_its_own_send() -> None:
    """eager.cut finds uvicorn's cycle from the `send` the app was given (no per-request
    closure: that would be a reference cycle per request); a wrapped send is left alone."""

    class Transport:
        closed = False

        def close(self) -> None:
            self.closed = True

    cycle = RequestResponseCycle.__new__(RequestResponseCycle)
    cycle.transport = Transport()  # type: ignore[assignment]
    cycle.response_complete = cycle.disconnected = False
    cycle.keep_alive = True
    cycle.message_event = asyncio.Event()

    async def wrapped(message: Any) -> None:
        await cycle.send(message)

    eager.cut(wrapped)
    assert not cycle.transport.closed and not cycle.disconnected  # type: ignore[attr-defined]
    eager.cut(cycle.send)
    assert cycle.transport.closed  # type: ignore[attr-defined]
    assert cycle.disconnected and not cycle.keep_alive and cycle.message_event.is_set()
