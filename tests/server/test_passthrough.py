"""Transparency (CONTRACT section 5): what is not a fenced stream comes back unchanged, and
several upstreams are routed by longest prefix with the prefix stripped."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from proxy.config.load import from_dict
from proxy.server.app import create_app
from tests.conftest import Proxy
from tests.scripted import ScriptedUpstream, serve
from tests.sse_client import chat_body, events

CHAT = "/v1/chat/completions"


async def _direct_and_proxied(
    proxy: Proxy, upstream: ScriptedUpstream, method: str, path: str, **kw: object
) -> tuple[httpx.Response, httpx.Response]:
    async with httpx.AsyncClient(base_url=upstream.url) as direct, proxy.client() as via:
        return (
            await direct.request(method, path, **kw),  # type: ignore[arg-type]
            await via.request(method, path, **kw),  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("status", [200, 400, 404, 429, 500, 503])
async def test_json_responses_and_upstream_errors_come_back_unchanged(
    proxy: Proxy, upstream: ScriptedUpstream, status: int
) -> None:
    body = chat_body(stream=False, status=status, headers={"X-Upstream-Thing": "kept"})
    body["stream"] = False
    direct, via = await _direct_and_proxied(proxy, upstream, "POST", CHAT, json=body)
    assert via.status_code == direct.status_code == status
    assert via.content == direct.content
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert via.headers["x-upstream-thing"] == "kept"
    assert via.headers["content-length"] == direct.headers["content-length"]
    assert "x-should-retry" not in via.headers  # the upstream's retry advice is its own


async def test_get_with_query_reaches_the_same_path(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    direct, via = await _direct_and_proxied(
        proxy, upstream, "GET", "/v1/models/gpt%2F4?limit=2&after=x"
    )
    assert via.status_code == 200 and via.content == direct.content
    assert [(s.method, s.path, s.query) for s in upstream.seen] == [
        ("GET", "/v1/models/gpt/4", "limit=2&after=x")
    ] * 2
    assert "x-streamfence-attempt" not in via.headers  # no body, no turn


async def test_sse_response_headers(proxy: Proxy, upstream: ScriptedUpstream) -> None:
    async with proxy.client() as client:
        async with client.stream(
            "POST", CHAT, json=chat_body(headers={"X-Upstream-Thing": "kept"})
        ) as r:
            got = [e async for e in events(r)]
    assert r.headers["cache-control"] == "no-cache"
    assert r.headers["x-accel-buffering"] == "no"
    assert r.headers["x-upstream-thing"] == "kept"
    assert r.headers["content-type"].startswith("text/event-stream")
    assert len(r.headers["x-streamfence-turn"]) == 16
    assert r.headers["x-streamfence-attempt"] == "1"
    assert got[-1].data == "[DONE]"


async def test_encoded_bodies_pass_through_byte_for_byte(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    """Non-SSE bodies are streamed through, not parsed or decoded: whatever the upstream's
    content-encoding says, the client gets the upstream's bytes."""
    body = chat_body(stream=False, headers={"Content-Encoding": "gzip"})
    body["stream"] = False
    got = []
    for base in (upstream.url, proxy.url):
        async with httpx.AsyncClient(base_url=base) as client:
            async with client.stream("POST", CHAT, json=body) as r:
                raw = b"".join([chunk async for chunk in r.aiter_raw()])
                got.append((r.headers["content-encoding"], r.headers["content-length"], raw))
    assert got[0] == got[1]


@pytest.fixture
async def two_upstreams() -> AsyncIterator[tuple[ScriptedUpstream, ScriptedUpstream, str]]:
    a, b = ScriptedUpstream(), ScriptedUpstream()
    async with serve(a) as (a_url, _), serve(b) as (b_url, _):
        config = from_dict(
            {
                "upstream": [
                    {"name": "root", "prefix": "/", "url": a_url},
                    {"name": "anthropic", "prefix": "/anthropic", "url": b_url + "/base"},
                ]
            }
        )
        async with serve(create_app(config)) as (proxy_url, _):
            yield a, b, proxy_url


async def test_longest_prefix_wins_and_is_stripped(
    two_upstreams: tuple[ScriptedUpstream, ScriptedUpstream, str],
) -> None:
    a, b, url = two_upstreams
    async with httpx.AsyncClient(base_url=url) as client:
        to_b = await client.post("/anthropic/v1/messages", json={"x": 1})
        to_a = await client.post("/anthropicx/v1/messages", json={"x": 1})
        to_a2 = await client.get("/v1/models")
    assert [s.path for s in b.seen] == ["/base/v1/messages"]
    assert [s.path for s in a.seen] == ["/anthropicx/v1/messages", "/v1/models"]
    assert to_b.json()["type"] == "message"  # the anthropic-shaped answer of upstream b
    assert to_a.status_code == to_a2.status_code == 200
    assert json.loads(to_a2.content)["path"] == "/v1/models"


async def test_a_compressed_event_stream_is_decoded_and_goes_out_plain(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    """The relay must see events to fence them: a gzip-encoded SSE body is decoded, and the
    client gets plain events without the upstream's content-encoding."""
    plain = b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    body = chat_body()  # no script: the upstream's default below answers it
    upstream.default.raw_bytes = [gzip.compress(plain)]
    upstream.default.headers = {"Content-Encoding": "gzip"}
    async with proxy.client() as client, client.stream("POST", CHAT, json=body) as r:
        raw = b"".join([chunk async for chunk in r.aiter_raw()])
    assert "content-encoding" not in r.headers
    assert raw == plain


async def test_the_upstream_gets_the_callers_headers_and_no_client_defaults(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    # A raw request: an HTTP client would add its own Accept, Accept-Encoding, User-Agent.
    # A caller that did not ask for compression must not get a compressed answer.
    body = json.dumps(chat_body(stream=False)).encode()
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-caller-thing: kept\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
        % (CHAT.encode(), len(body), body)
    )
    response = await reader.read()
    writer.close()
    assert response.startswith(b"HTTP/1.1 200 ")
    seen = (await upstream.wait_requests(1))[0].headers
    assert seen["x-caller-thing"] == "kept"
    assert seen["content-type"] == "application/json"
    for added_by_a_client in ("accept", "accept-encoding", "user-agent", "cookie"):
        assert added_by_a_client not in seen
