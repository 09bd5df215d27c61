"""Bad input (CONTRACT section 6): each gets a clear error in the caller's dialect and
changes nothing else. Raw sockets where the shape of the request itself is the attack."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import Proxy, ProxyFactory
from tests.scripted import ScriptedUpstream
from tests.sse_client import chat_body

# Explicit: conftest adds the marker after collection, too late for parametrized tests.
pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


class RecordingTransport(httpx.AsyncBaseTransport):
    """The proxy's real upstream transport, remembering every URL it was asked to reach."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport(retries=0)
        self.urls: list[httpx.URL] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.urls.append(request.url)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def raw_exchange(url: str, data: bytes) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it (or the first
    complete response, when the server keeps the connection open)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(data)
        await writer.drain()
        got = b""
        async with asyncio.timeout(5):
            while chunk := await reader.read(65536):
                got += chunk
                if _complete(got):
                    break
        return got
    finally:
        writer.close()


def _complete(got: bytes) -> bool:
    head, sep, body = got.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


@pytest.fixture
async def recording_proxy(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> AsyncIterator[tuple[Proxy, RecordingTransport]]:
    transport = RecordingTransport()
    async with make_proxy(upstream.url, _app={"transport": transport}) as p:
        yield p, transport


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (b"", "empty"),
        (b"   ", "empty"),
        (b"x" * 257, "over"),
        (b"turn\x01id", "control"),
        (b"turn\x7fid", "control"),
        (b"turn\tid", "control"),
    ],
)
async def test_bad_turn_id_is_400_in_the_callers_dialect_and_nothing_is_forwarded(
    proxy: Proxy, upstream: ScriptedUpstream, value: bytes, why: str
) -> None:
    head = (
        f"POST {MESSAGES} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        "content-length: 2\r\n"
    ).encode()
    response = await raw_exchange(proxy.url, head + b"X-Turn-Id: " + value + b"\r\n\r\n{}")
    assert status_of(response) == 400, response
    head, _, raw_body = response.partition(b"\r\n\r\n")
    if b"application/json" in head.lower():
        body = json.loads(raw_body)
        # Anthropic's shape, because the path is /v1/messages.
        assert body["type"] == "error" and body["error"]["type"] == "bad_request"
        assert why.split()[0] in body["error"]["message"]
    else:
        # httptools refuses most control characters in a header value itself, before the
        # proxy sees the request: still a 400, still nothing forwarded.
        assert why == "control"
    assert upstream.seen == []
    assert proxy.runtime.registry.live_keys() == 0


async def test_turn_id_of_exactly_256_bytes_is_accepted(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    async with proxy.client() as client:
        r = await client.post(CHAT, json=chat_body(stream=False), headers={"X-Turn-Id": "t" * 256})
    assert r.status_code == 200
    assert r.headers["x-streamfence-attempt"] == "1"


async def test_duplicated_turn_id_is_400(proxy: Proxy, upstream: ScriptedUpstream) -> None:
    async with proxy.client() as client:
        r = await client.post(
            CHAT,
            json=chat_body(stream=False),
            headers=[("X-Turn-Id", "a"), ("X-Turn-Id", "b")],
        )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "bad_request"
    assert upstream.seen == []


async def test_body_over_the_limit_is_413_by_header_and_by_chunks(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(upstream.url, **{"server.max_body_bytes": 1000}) as p:
        async with p.client() as client:
            declared = await client.post(CHAT, content=b"x" * 1001)

            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(5):
                    yield b"y" * 300

            chunked = await client.post(CHAT, content=chunks())  # no content-length
            at_limit = await client.post(CHAT, content=b"z" * 1000)
    for r in (declared, chunked):
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "body_too_large"
        assert r.headers["x-should-retry"] == "false"
    assert at_limit.status_code == 200
    assert [s.body for s in upstream.seen] == [b"z" * 1000]


async def test_invalid_json_is_forwarded_without_a_fingerprint(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    bad = [b"{not json", b"\xff\xfe\x00garbage", b'{"a": 1', b""]
    async with proxy.client() as client:
        responses = [await client.post(CHAT, content=body) for body in bad]
        # Two identical invalid bodies at once: no fingerprint, so neither fences the other.
        twins = await asyncio.gather(*(client.post(CHAT, content=b"{oops") for _ in range(2)))
    for r in [*responses, *twins]:
        assert r.status_code == 200
        assert "x-streamfence-turn" not in r.headers
    assert [s.body for s in upstream.seen[: len(bad)]] == bad
    assert proxy.runtime.registry.live_keys() == 0


async def test_path_matching_no_upstream_is_404(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(upstream.url, **{"upstream.prefix": "/openai"}) as p:
        async with p.client() as client:
            miss = await client.post("/anthropic/v1/messages", json={"x": 1})
            near = await client.post("/openaiX/v1/chat/completions", json={"x": 1})
            hit = await client.post("/openai/v1/chat/completions", json=chat_body(stream=False))
            own = await client.get("/_streamfence/nope")
    assert miss.status_code == 404
    assert miss.json()["error"]["type"] == "no_route"  # Anthropic's shape for /messages
    assert near.status_code == 404
    assert own.status_code == 404
    assert hit.status_code == 200
    assert [s.path for s in upstream.seen] == ["/v1/chat/completions"]


async def test_absolute_form_target_never_changes_the_destination(
    recording_proxy: tuple[Proxy, RecordingTransport], upstream: ScriptedUpstream
) -> None:
    proxy, transport = recording_proxy
    request = (
        b"GET http://evil.example:9/steal?q=1 HTTP/1.1\r\n"
        b"Host: evil.example:9\r\nConnection: close\r\n\r\n"
    )
    response = await raw_exchange(proxy.url, request)
    # httptools keeps only the path of an absolute-form target: the request goes to the
    # configured upstream, with the upstream's own Host, and nowhere else.
    assert status_of(response) == 200, response
    up = urlsplit(upstream.url)
    assert [(u.host, u.port) for u in transport.urls] == [(up.hostname, up.port)]
    assert [(s.path, s.query) for s in upstream.seen] == [("/steal", "q=1")]
    assert upstream.seen[0].headers["host"] == f"{up.hostname}:{up.port}"


async def test_host_header_naming_another_host_never_changes_the_destination(
    recording_proxy: tuple[Proxy, RecordingTransport], upstream: ScriptedUpstream
) -> None:
    proxy, transport = recording_proxy
    async with proxy.client() as client:
        for host in ("evil.example", "169.254.169.254", "localhost:1", "[::1]:22"):
            r = await client.post(CHAT, json=chat_body(stream=False), headers={"Host": host})
            assert r.status_code == 200
    up = urlsplit(upstream.url)
    assert len(transport.urls) == 4
    assert {(u.host, u.port) for u in transport.urls} == {(up.hostname, up.port)}
    assert {s.headers["host"] for s in upstream.seen} == {f"{up.hostname}:{up.port}"}


async def test_hop_by_hop_and_turn_headers_never_reach_the_upstream(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    async with proxy.client() as client:
        r = await client.post(
            CHAT,
            json=chat_body(stream=False),
            headers={
                "X-Turn-Id": "secret-turn",
                "Connection": "keep-alive, X-Private",
                "X-Private": "drop me (named in Connection)",
                "Keep-Alive": "timeout=5",
                "Proxy-Authorization": "Basic c2VjcmV0",
                "Proxy-Connection": "keep-alive",
                "TE": "trailers",
                "Trailer": "X-Foo",
                "Upgrade": "h2c",
                "x-streamfence-token": "not-a-token-here",
                "X-Kept": "yes",
            },
        )
    assert r.status_code == 200
    sent = upstream.seen[0].headers
    # httpx opens its own keep-alive hop; the client's Connection header is not it.
    assert sent.get("connection", "keep-alive") == "keep-alive"
    for name in (
        "x-turn-id",
        "x-private",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "x-streamfence-token",
    ):
        assert name not in sent, name
    assert sent["x-kept"] == "yes"
    assert "secret-turn" not in json.dumps(sent)


SMUGGLING = {
    "cl_and_te": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    ),
    "te_and_cl": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 40\r\n\r\n0\r\n\r\n"
        b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    ),
    "duplicate_cl_different": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Content-Length: 40\r\n\r\n{}"
        b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    ),
    "duplicate_cl_same": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Content-Length: 2\r\n\r\n{}"
        b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    ),
    "cl_list": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 40\r\n\r\n{}"
        b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    ),
    "te_not_chunked_last": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n"
        b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    ),
    "te_obfuscated": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n"
        b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    ),
}


@pytest.mark.parametrize("shape", sorted(SMUGGLING))
async def test_request_smuggling_shapes_are_rejected(
    proxy: Proxy, upstream: ScriptedUpstream, shape: str
) -> None:
    response = await raw_exchange(proxy.url, SMUGGLING[shape])
    # Rejected by the HTTP parser (uvicorn + httptools answers 400 and closes), never
    # read as two requests: nothing reaches the upstream, least of all /smuggled.
    assert status_of(response) == 400, response
    assert upstream.seen == []
    assert response.count(b"HTTP/1.1 ") == 1
