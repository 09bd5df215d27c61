"""WebSocket mode, the relay (CONTRACT section 8): routing, headers, frames both ways, close
codes, refused and impossible upgrades. The proxy runs under real uvicorn; behind it a real
`websockets` server (tests/ws_upstream.py); in front the `websockets` client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.conftest import Proxy, ProxyFactory
from tests.probes import metric
from tests.scripted import free_port
from tests.ws_upstream import WsUpstream, ws_upstream


@pytest.fixture
async def wsup() -> AsyncIterator[WsUpstream]:
    async with ws_upstream() as upstream:
        yield upstream


def ws_url(proxy: Proxy, path: str) -> str:
    return proxy.url.replace("http://", "ws://") + path


async def test_frames_relayed_both_ways_unchanged(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    wsup.echo = True
    async with make_proxy(wsup.url) as proxy:
        async with connect(ws_url(proxy, "/any/path?x=1")) as ws:
            samples: list[str | bytes] = [
                "hello",
                "",
                "ünïcødé ✓",
                b"\x00\xffbinary",
                b"",
                "x" * 70000,
            ]
            for sample in samples:
                await ws.send(sample)
                back = await ws.recv()
                assert back == sample and type(back) is type(sample)
        conn = (await wsup.wait_conns(1))[0]
        assert conn.path == "/any/path?x=1"
        assert conn.messages == samples
        labels = {"upstream": "default"}
        assert (
            metric(
                proxy.runtime,
                "streamfence_websocket_frames_total",
                **labels,
                direction="client_to_upstream",
            )
            == 6
        )
        assert (
            metric(
                proxy.runtime,
                "streamfence_websocket_frames_total",
                **labels,
                direction="upstream_to_client",
            )
            == 6
        )
        assert (
            metric(
                proxy.runtime,
                "streamfence_websocket_connections_total",
                **labels,
                outcome="accepted",
            )
            == 1
        )


async def test_headers_credentials_forwarded_turn_and_token_stripped(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    wsup.echo = True
    async with make_proxy(wsup.url, **{"server.access_token": "tok"}) as proxy:
        headers = {
            "Authorization": "Bearer sk-a",
            "X-Turn-Id": "turn-1",
            "x-streamfence-token": "tok",
            "OpenAI-Beta": "responses_websockets=2026-02-06",
            "User-Agent": "agent/1.0",
        }
        async with connect(
            ws_url(proxy, "/v1/chat"),
            additional_headers=headers,
            subprotocols=["proto-b", "proto-a"],
        ) as ws:
            await ws.send("ping")
            assert await ws.recv() == "ping"
            client_key = ws.request.headers["Sec-WebSocket-Key"] if ws.request else ""
            assert ws.subprotocol is None  # the upstream chose none: neither does the proxy
        up = (await wsup.wait_conns(1))[0].headers
        assert up["Authorization"] == "Bearer sk-a"
        assert up["OpenAI-Beta"] == "responses_websockets=2026-02-06"
        assert up.get_all("User-Agent") == ["agent/1.0"]
        assert "X-Turn-Id" not in up and "x-streamfence-token" not in up
        assert up["Sec-WebSocket-Key"] != client_key  # each hop has its own handshake
        assert len(up.get_all("Sec-WebSocket-Key")) == 1


async def test_subprotocol_and_compression_negotiated_per_side(make_proxy: ProxyFactory) -> None:
    from websockets.asyncio.server import ServerConnection, serve

    seen: dict[str, Any] = {}

    async def handler(ws: ServerConnection) -> None:
        seen["extensions"] = [e.name for e in ws.protocol.extensions]
        async for message in ws:
            await ws.send(message)

    async with serve(handler, "127.0.0.1", 0, subprotocols=["proto-a"]) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with make_proxy(f"http://127.0.0.1:{port}") as proxy:
            async with connect(ws_url(proxy, "/s"), subprotocols=["proto-b", "proto-a"]) as ws:
                assert ws.subprotocol == "proto-a"
                assert [e.name for e in ws.protocol.extensions] == ["permessage-deflate"]
                await ws.send("z" * 100_000)
                assert await ws.recv() == "z" * 100_000
            async with connect(
                ws_url(proxy, "/s"), compression=None, subprotocols=["proto-a"]
            ) as ws:
                assert ws.protocol.extensions == []
                await ws.send("plain")
                assert await ws.recv() == "plain"
    assert seen["extensions"] == ["permessage-deflate"]  # the upstream hop compresses anyway


async def test_close_codes_pass_through_both_ways(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    wsup.echo = True
    async with make_proxy(wsup.url) as proxy:
        async with connect(ws_url(proxy, "/c")) as ws:
            await ws.send("x")
            await ws.recv()
            await ws.close(4001, "client says bye")
        conn = (await wsup.wait_conns(1))[0]
        await conn.closed.wait()
        assert (conn.close_code, conn.close_reason) == (4001, "client says bye")

        wsup.echo = False  # the scripted responder closes the socket after response.created
        async with connect(ws_url(proxy, "/v1/responses")) as ws:
            await ws.send(json.dumps({"type": "response.create", "script": {"close_code": 4002}}))
            assert json.loads(await ws.recv())["type"] == "response.created"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None
            assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4002, "scripted close")
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0


async def test_refused_upstream_handshake_passes_status_headers_and_body(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    body = (
        b'{"error":{"message":"bad key","type":"invalid_request_error","code":"invalid_api_key"}}'
    )
    wsup.refuse = (401, {"Content-Type": "application/json", "X-Request-Id": "req_9"}, body)
    async with make_proxy(wsup.url) as proxy:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(ws_url(proxy, "/v1/responses")):
                pass
        response = refused.value.response
        assert response.status_code == 401
        assert response.body == body
        assert response.headers["X-Request-Id"] == "req_9"
        outcome = {"upstream": "default", "outcome": "refused"}
        assert metric(proxy.runtime, "streamfence_websocket_connections_total", **outcome) == 1


async def test_no_upstream_answers_426_at_once_in_the_callers_dialect(
    make_proxy: ProxyFactory,
) -> None:
    async with make_proxy(f"http://127.0.0.1:{free_port()}") as proxy:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(ws_url(proxy, "/v1/responses"), open_timeout=5):
                pass
        response = refused.value.response
        assert response.status_code == 426
        error = json.loads(response.body)["error"]
        assert error["code"] == "websocket_unavailable" and "HTTP" in error["message"]
        outcome = {"upstream": "default", "outcome": "unreachable"}
        assert metric(proxy.runtime, "streamfence_websocket_connections_total", **outcome) == 1
        # A raw client sees the status line exactly: never a bare 403.
        async with httpx.AsyncClient() as http:
            r = await http.get(
                proxy.url + "/v1/responses",
                headers={
                    "Connection": "Upgrade",
                    "Upgrade": "websocket",
                    "Sec-WebSocket-Version": "13",
                    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                },
            )
        assert r.status_code == 426 and r.json()["error"]["type"] == "websocket_unavailable"


@pytest.mark.parametrize(
    ("path", "headers", "status", "code"),
    [
        ("/_streamfence/feed", {"x-streamfence-token": "tok"}, 404, "no_route"),
        ("/v1/responses", {}, 401, "unauthorized"),
        ("/v1/responses", {"x-streamfence-token": "tok", "X-Turn-Id": "  "}, 400, "bad_request"),
        ("/other/v1/responses", {"x-streamfence-token": "tok"}, 404, "no_route"),
    ],
)
async def test_upgrades_that_cannot_be_routed_get_a_clear_status(
    wsup: WsUpstream,
    make_proxy: ProxyFactory,
    path: str,
    headers: dict[str, str],
    status: int,
    code: str,
) -> None:
    overrides = {"server.access_token": "tok", "upstream.prefix": "/v1"}
    async with make_proxy(wsup.url, **overrides) as proxy:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(ws_url(proxy, path), additional_headers=headers):
                pass
        assert refused.value.response.status_code == status
        assert json.loads(refused.value.response.body)["error"]["code"] == code
    assert wsup.conns == []


async def test_client_message_over_the_limit_closes_1009(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    wsup.echo = True
    async with make_proxy(wsup.url, **{"server.websocket_max_message_bytes": 1000}) as proxy:
        async with connect(ws_url(proxy, "/c"), max_size=None) as ws:
            await ws.send("y" * 1000)
            assert await ws.recv() == "y" * 1000
            await ws.send("y" * 1001)
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
            assert closed.value.rcvd.reason == "streamfence: message over 1000 bytes"
        conn = (await wsup.wait_conns(1))[0]
        await conn.closed.wait()
        assert conn.messages == ["y" * 1000]


async def open_ws(proxy: Proxy, path: str = "/v1/responses", **kw: Any) -> ClientConnection:
    return await connect(ws_url(proxy, path), **kw)


async def test_client_leaving_during_the_upstream_handshake_leaves_nothing_open(
    make_proxy: ProxyFactory,
) -> None:
    import asyncio

    from websockets.asyncio.server import ServerConnection, serve

    closed = asyncio.Event()
    gave_up = asyncio.Event()

    async def slow(conn: ServerConnection, request: Any) -> None:
        await gave_up.wait()  # the handshake answers only once the client has left

    async def handler(ws: ServerConnection) -> None:
        await ws.wait_closed()
        closed.set()

    async with serve(handler, "127.0.0.1", 0, process_request=slow) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with make_proxy(f"http://127.0.0.1:{port}") as proxy:
            with pytest.raises(TimeoutError):
                await connect(ws_url(proxy, "/s"), open_timeout=0.2)
            gave_up.set()
            await asyncio.wait_for(closed.wait(), 5)  # the proxy closed its upstream socket
            outcome = {"upstream": "default", "outcome": "client_gone"}
            assert metric(proxy.runtime, "streamfence_websocket_connections_total", **outcome) == 1
            assert metric(proxy.runtime, "streamfence_websocket_open") == 0
