"""Security: callers are isolated by credential, secrets never leak, the proxy's own access
token guards everything, and an open listening address is warned about.

The leak sweep plants secrets in every place a caller can put them (Authorization, x-api-key,
the Gemini `?key=`, the body, the turn id, the proxy's own token), drives one request of every
outcome, then greps everything the proxy produced: its logs, its metrics, its status feed,
every response header and body, and what reached the upstream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from proxy.config.load import load
from proxy.server import serve
from tests.conftest import Proxy, ProxyFactory
from tests.scripted import ScriptedUpstream, free_port
from tests.sse_client import chat_body, events, open_stream
from tests.stress import harness

pytestmark = pytest.mark.anyio

CHAT = "/api/v1/chat/completions"
API_KEY = "sk-PLANTED-authorization-4f1c9e2a"
X_API_KEY = "sk-ant-PLANTED-xapikey-77b1"
QUERY_KEY = "AIzaPLANTED-query-key-90d3"
BODY_SECRET = "PLANTED-body-secret-5e6f"
TURN_SECRET = "PLANTED-turn-id-c0ffee"
TOKEN = "PLANTED-proxy-token-1a2b3c"
SECRETS = (API_KEY, X_API_KEY, QUERY_KEY, BODY_SECRET, TURN_SECRET, TOKEN)


def secret_headers(**extra: str) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {API_KEY}",
        "x-api-key": X_API_KEY,
        "X-Turn-Id": TURN_SECRET,
        "x-streamfence-token": TOKEN,
        **extra,
    }


def secret_body(**script: Any) -> dict[str, Any]:
    body = chat_body(BODY_SECRET, **script)
    body["metadata"] = {"note": BODY_SECRET}
    return body


def leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


class Seen:
    """Everything the proxy sent back, to grep afterwards."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def response(self, r: httpx.Response, body: bytes | None = None) -> None:
        self.parts.append(f"{r.status_code} {list(r.headers.raw)!r}")
        self.parts.append((r.content if body is None else body).decode("utf-8", "replace"))


async def test_planted_secrets_never_appear_in_logs_metrics_headers_or_errors(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # The test's own httpx client logs the URLs it calls (the proxy's, ?key= included) at
    # INFO; the proxy sends through httpx's transports only, which log no URL. (This order:
    # set_level also sets the capture handler's level, which must end at DEBUG.)
    caplog.set_level(logging.WARNING, logger="httpx")
    caplog.set_level(logging.DEBUG)
    overrides = {
        "upstream.0.prefix": "/api",
        "upstream.1.url": f"http://127.0.0.1:{free_port()}",  # nobody listens: 502
        "upstream.1.prefix": "/dead",
        "upstream.1.name": "dead",
        "server.access_token": TOKEN,
        "server.max_body_bytes": 4096,
        "server.log_format": "json",
    }
    out = Seen()
    async with make_proxy(upstream.url, **overrides) as p, p.client() as client:
        watch = harness.watch(p.runtime)

        async def post(path: str = CHAT, **kw: Any) -> httpx.Response:
            kw.setdefault("json", secret_body(stream=False))
            kw.setdefault("headers", secret_headers())
            r = await client.post(path, **kw)
            out.response(r)
            return r

        # Completed, streamed and whole; Gemini-style key in the query.
        assert (await post(json=secret_body(stream=False))).status_code == 200
        async with client.stream(
            "POST",
            "/api/v1beta/models/m:streamGenerateContent",
            params={"alt": "sse", "key": QUERY_KEY},
            json=secret_body(stream=True),
            headers=secret_headers(**{"X-Turn-Id": TURN_SECRET + "-g"}),
        ) as r:
            out.response(r, b"".join([c async for c in r.aiter_raw()]))
        # Superseded mid-stream, and 409 before headers.
        async with client.stream(
            "POST", CHAT, json=secret_body(gated=True, tokens=5), headers=secret_headers()
        ) as old:
            it = events(old)
            await anext(it)
            await post(json=secret_body(stream=False))
            frame = [e async for e in it]
            out.response(old, json.dumps([e.data for e in frame]).encode())
        assert frame[-1].json["error"]["code"] == "stream_superseded"
        waiting = asyncio.create_task(post(json=secret_body(hold_headers=True)))
        seen = await upstream.wait_requests(len(upstream.seen) + 1)
        await post(json=secret_body(stream=False))
        assert (await waiting).status_code == 409
        seen[-2].release()
        # Upstream failure status, unreachable upstream, bad input of each kind.
        assert (await post(json=secret_body(status=500))).status_code == 500
        assert (await post("/dead/v1/chat/completions")).status_code == 502
        bad_turn = secret_headers(**{"X-Turn-Id": TURN_SECRET + "\t" + "x" * 300})
        assert (await post(headers=bad_turn)).status_code == 400
        too_big = {**secret_body(), "pad": BODY_SECRET * 400}
        assert (await post(json=too_big)).status_code == 413
        assert (await post(f"/nowhere-{BODY_SECRET[:0]}x")).status_code == 404
        no_token = {k: v for k, v in secret_headers().items() if k != "x-streamfence-token"}
        assert (await post(headers=no_token)).status_code == 401
        wrong = secret_headers(**{"x-streamfence-token": TOKEN + "x"})
        assert (await post(headers=wrong)).status_code == 401
        # A client that leaves mid-stream.
        async with client.stream(
            "POST", CHAT, json=secret_body(gated=True, tokens=9), headers=secret_headers()
        ) as r:
            await anext(events(r))
        await watch.wait(14)

        metrics = await client.get("/_streamfence/metrics", headers={"x-streamfence-token": TOKEN})
        assert metrics.status_code == 200
        out.parts.append(metrics.text)
        async with client.stream(
            "GET", "/_streamfence/feed", headers={"x-streamfence-token": TOKEN}
        ) as feed:
            assert feed.status_code == 200
            out.parts.append((await anext(events(feed))).data)  # the first snapshot

    logged = caplog.text + "".join(r.getMessage() for r in caplog.records)
    assert "request" in logged  # the request log lines were captured
    assert leaks(logged) == [], [line for line in caplog.text.splitlines() if leaks(line)][:5]
    for part in out.parts:
        assert leaks(part) == [], part[:500]
    # Upstream: credentials are the caller's to send on; the proxy's token and the turn id
    # are the proxy's, and stop there.
    for request in upstream.seen:
        sent = json.dumps(request.headers)
        assert TOKEN not in sent and TURN_SECRET not in sent
        assert request.headers.get("authorization") == f"Bearer {API_KEY}"


async def test_access_token_guards_every_path_and_nothing_is_forwarded_without_it(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(upstream.url, **{"server.access_token": TOKEN}) as p:
        async with p.client() as client:
            denied = [
                await client.post("/v1/chat/completions", json=chat_body()),
                await client.get("/v1/models"),
                await client.delete("/v1/files/x", headers={"x-streamfence-token": ""}),
                await client.post(
                    "/v1/messages", json={}, headers={"x-streamfence-token": TOKEN[:-1]}
                ),
                await client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}),
                await client.get("/_streamfence/metrics"),
                await client.get("/_streamfence/"),
            ]
            allowed = await client.get("/v1/models", headers={"x-streamfence-token": TOKEN})
            health = await client.get("/_streamfence/healthz")
    assert [r.status_code for r in denied] == [401] * len(denied)
    assert denied[0].json()["error"]["code"] == "unauthorized"
    assert denied[3].json()["error"]["type"] == "unauthorized"  # Anthropic's shape
    assert all(TOKEN not in r.text for r in denied)
    assert allowed.status_code == 200
    assert health.status_code == 200  # probes stay open: they reveal nothing
    # Only the allowed request reached the upstream, without the proxy's token.
    assert [(s.method, s.path) for s in upstream.seen] == [("GET", "/v1/models")]
    assert "x-streamfence-token" not in upstream.seen[0].headers


async def test_another_credential_can_never_fence_a_turn(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    async with proxy.client() as client, AsyncExitStack() as stack:
        a = await open_stream(
            stack,
            client,
            "/v1/chat/completions",
            chat_body(gated=True, prefix="A"),
            {"X-Turn-Id": "shared", "Authorization": "Bearer key-A"},
        )
        a_events = events(a)
        await anext(a_events)
        rivals = [
            # Same turn id under other credentials (another key, another header, none).
            {"X-Turn-Id": "shared", "Authorization": "Bearer key-B"},
            {"X-Turn-Id": "shared", "x-api-key": "key-A"},
            {"X-Turn-Id": "shared"},
            # Identical body, fingerprinted, under another credential.
            {"Authorization": "Bearer key-B"},
        ]
        answers = []
        for headers in rivals:
            body = chat_body(stream=False) if "X-Turn-Id" in headers else chat_body(prefix="A")
            body["stream"] = False
            answers.append(await client.post("/v1/chat/completions", json=body, headers=headers))
        upstream.seen[0].release(10)
        rest = [e async for e in a_events]
    assert [r.status_code for r in answers] == [200] * len(rivals)
    assert all(r.headers["x-streamfence-attempt"] == "1" for r in answers)
    # A's turn is not observable either: nobody else is told A's (hashed) turn key.
    assert a.headers["x-streamfence-turn"] not in {r.headers["x-streamfence-turn"] for r in answers}
    assert "".join(e.text for e in rest) == "A1 A2 "
    assert rest[-1].data == "[DONE]"


@pytest.mark.parametrize("mode", ["join", "adaptive"])
async def test_another_credential_never_joins_or_replays_a_running_stream(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, mode: str
) -> None:
    body = chat_body(gated=True, tokens=4, prefix="A")
    async with make_proxy(upstream.url, **{"upstream.on_retry": mode}) as p:
        async with p.client() as client, AsyncExitStack() as stack:
            a = await open_stream(
                stack,
                client,
                "/v1/chat/completions",
                body,
                {"X-Turn-Id": "t", "Authorization": "Bearer key-A"},
            )
            a_events = events(a)
            first = await anext(a_events)
            b = await open_stream(
                stack,
                client,
                "/v1/chat/completions",
                body,
                {"X-Turn-Id": "t", "Authorization": "Bearer key-B"},
            )
            # B got an upstream request of its own, with its own credential.
            seen = await upstream.wait_requests(2)
            assert seen[1].headers["authorization"] == "Bearer key-B"
            for s in seen:
                s.release(10)
            b_events = [e async for e in events(b)]
            a_rest = [e async for e in a_events]
    assert first.text == "A0 "
    assert "".join(e.text for e in a_rest) == "A1 A2 A3 "  # A was neither fenced nor shared
    assert b.headers["x-streamfence-attempt"] == "1"
    assert b.headers["x-streamfence-turn"] != a.headers["x-streamfence-turn"]
    assert len(upstream.seen) == 2
    assert "".join(e.text for e in b_events) == "A0 A1 A2 A3 "  # its own stream, whole
    assert b_events[-1].data == "[DONE]"


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [
        ("0.0.0.0", "", True),
        ("::", "", True),
        ("192.168.1.10", "", True),
        ("proxy.internal", "", True),
        ("0.0.0.0", "set", False),
        ("127.0.0.1", "", False),
        ("127.0.0.2", "", False),
        ("::1", "", False),
        ("localhost", "", False),
    ],
)
def test_a_non_loopback_address_without_a_token_is_warned_about(
    host: str, token: str, warned: bool
) -> None:
    config = load(
        env={},
        overrides={
            "upstream.url": "http://127.0.0.1:9",
            "server.host": host,
            "server.access_token": token,
        },
    )
    lines = serve.startup_lines(config)
    warning = [line for line in lines if "WARNING" in line]
    assert bool(warning) == warned, lines
    if warned:
        assert host in warning[0] and "access_token" in warning[0]
    assert all("set" not in line.split() for line in lines)  # the token is never printed
