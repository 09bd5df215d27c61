"""WebSocket mode, fencing per response on /v1/responses (CONTRACT sections 2-4 and 8): each
response.create is an attempt keyed like an HTTP body; a superseded response's client gets
one `error` event and nothing after, and its generation upstream is stopped."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from proxy.errors import ShuttingDown
from proxy.wire import health
from tests.conftest import Proxy, ProxyFactory
from tests.probes import metric
from tests.redis_server import REDIS_SERVER, running_redis
from tests.scripted import ScriptedUpstream, free_port
from tests.ws_upstream import WsUpstream, ws_upstream

# The scripted upstream reads each message's "script"; a retry of a turn may script its answer
# differently and must still be the same request: the fingerprint ignores it.
SCRIPT = {"turns.ignore_fields": "stream,stream_options,timeout,script"}
# Every identical repeat supersedes (for tests of the fence itself, not of on_retry).
SUPERSEDE = {**SCRIPT, "upstream.on_retry": "supersede"}
FORBIDDEN = (
    "terminated",
    "connection lost",
    "network error",
    "peer closed",
    "broken pipe",
    "reset",
)


@pytest.fixture
async def wsup() -> AsyncIterator[WsUpstream]:
    async with ws_upstream() as upstream:
        yield upstream


def ws_url(proxy: Proxy, path: str = "/v1/responses") -> str:
    return proxy.url.replace("http://", "ws://") + path


def create(text: str = "hi", **script: Any) -> str:
    message: dict[str, Any] = {"type": "response.create", "model": "m", "input": text}
    if script:
        message["script"] = script
    return json.dumps(message)


async def events_until_end(ws: ClientConnection) -> list[dict[str, Any]]:
    """Events of one response, through its terminal one."""
    out: list[dict[str, Any]] = []
    while True:
        event = json.loads(await ws.recv())
        out.append(event)
        if event["type"] in ("response.completed", "response.failed", "error"):
            return out


async def opening(ws: ClientConnection) -> None:
    """The two events a gated response sends before its first token."""
    kinds = [json.loads(await ws.recv())["type"] for _ in range(2)]
    assert kinds == ["response.created", "response.output_item.added"]


async def past_keepalives(ws: ClientConnection) -> dict[str, Any]:
    """The next event that is not a keep-alive (those are relayed as they came)."""
    while (event := json.loads(await ws.recv()))["type"] == "keepalive":
        pass
    return event  # type: ignore[no-any-return]


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


async def test_plain_turn_and_outcome_counted(wsup: WsUpstream, make_proxy: ProxyFactory) -> None:
    async with make_proxy(wsup.url, **SCRIPT) as proxy, connect(ws_url(proxy)) as ws:
        await ws.send(create(tokens=["Hel", "lo"]))
        events = await events_until_end(ws)
        assert [e["type"] for e in events][0] == "response.created"
        assert events[-1]["type"] == "response.completed" and text_of(events) == "Hello"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        await proxy.runtime.wait_idle()
        labels = {"upstream": "default", "dialect": "openai-responses", "outcome": "completed"}
        assert metric(proxy.runtime, "streamfence_requests_total", **labels) == 1
        assert proxy.runtime.registry.live_keys() == 0


async def test_stall_retry_over_a_second_socket_fences_the_first(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SCRIPT, **{"upstream.healthy_within": 0.2}) as proxy:
        first = await connect(ws_url(proxy))
        await first.send(create("same", gated=True, tokens=5, prefix="a"))
        gen1 = (await wsup.wait_gens(1))[0]
        gen1.release(1)
        got = [json.loads(await first.recv()) for _ in range(3)]  # created, item added, delta
        assert got[-1]["type"] == "response.output_text.delta"
        await asyncio.sleep(0.3)  # the stall itself: no event for longer than healthy_within

        async with connect(ws_url(proxy)) as second:
            await second.send(create("same", tokens=2, prefix="b"))
            error = json.loads(await first.recv())
            assert error["type"] == "error" and error["code"] == "stream_superseded"
            assert error["error"]["code"] == "stream_superseded"
            assert error["sequence_number"] == got[-1]["sequence_number"] + 1
            assert "attempt 1" in error["message"] and "attempt 2" in error["message"]
            assert not any(word in error["message"].lower() for word in FORBIDDEN)
            await asyncio.wait_for(gen1.over.wait(), 1)  # its upstream socket was closed
            assert gen1.cut and gen1.events_sent < 7
            gen1.release(10)
            events = await events_until_end(second)
            assert events[-1]["type"] == "response.completed" and text_of(events) == "b0 b1 "

        # Nothing of the fenced response after its error; the first socket still works, on a
        # new upstream socket.
        await first.send(create("next turn", tokens=1, prefix="c"))
        events = await events_until_end(first)
        assert [e["type"] for e in events][0] == "response.created"
        assert text_of(events) == "c0 " and events[-1]["type"] == "response.completed"
        assert len(await wsup.wait_conns(3)) == 3
        await first.close()
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0
        labels = {"upstream": "default", "dialect": "openai-responses"}
        assert (
            metric(proxy.runtime, "streamfence_requests_total", **labels, outcome="superseded") == 1
        )
        assert (
            metric(proxy.runtime, "streamfence_requests_total", **labels, outcome="completed") == 2
        )
        assert metric(proxy.runtime, "streamfence_supersedes_total", upstream="default") == 1


async def test_supersede_over_http_with_the_same_turn_id(
    wsup: WsUpstream, upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    overrides = {
        "upstream.0.name": "ws",
        "upstream.0.prefix": "/ws",
        "upstream.1.url": upstream.url,
        "upstream.1.name": "http",
        "upstream.1.prefix": "/",
    }
    async with make_proxy(wsup.url, **SCRIPT, **overrides) as proxy:
        turn = {"X-Turn-Id": "turn-7", "Authorization": "Bearer sk-1"}
        ws = await connect(ws_url(proxy, "/ws/v1/responses"), additional_headers=turn)
        await ws.send(create("over ws", gated=True, tokens=3))
        gen = (await wsup.wait_gens(1))[0]
        await opening(ws)

        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
            body = {"model": "m", "input": "over http", "stream": True}
            r = await http.post("/v1/responses", json=body, headers=turn)
            assert r.status_code == 200 and "response.completed" in r.text
            assert r.headers["x-streamfence-attempt"] == "2"
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["code"] == "stream_superseded"
        await asyncio.wait_for(gen.over.wait(), 1)
        assert gen.cut
        # Another credential with the same turn id fences nobody.
        other = {"X-Turn-Id": "turn-7", "Authorization": "Bearer sk-2"}
        async with connect(ws_url(proxy, "/ws/v1/responses"), additional_headers=other) as ws2:
            await ws2.send(create("other caller", gated=True, tokens=1))
            gen2 = (await wsup.wait_gens(2))[1]
            async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as http:
                r = await http.post("/v1/responses", json=body, headers=turn)
                assert r.status_code == 200
            gen2.release(1)
            events = await events_until_end(ws2)
            assert events[-1]["type"] == "response.completed"
        await ws.close()
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0


async def test_same_socket_new_attempt_of_the_turn_supersedes_and_is_sent_again(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SCRIPT) as proxy:
        async with connect(ws_url(proxy), additional_headers={"X-Turn-Id": "t"}) as ws:
            await ws.send(create("first", gated=True, tokens=3))
            gen1 = (await wsup.wait_gens(1))[0]
            await opening(ws)
            await ws.send(create("edited", tokens=2, prefix="e"))
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["code"] == "stream_superseded"
            events = await events_until_end(ws)
            assert text_of(events) == "e0 e1 " and events[-1]["type"] == "response.completed"
            assert gen1.cut
            conns = await wsup.wait_conns(2)
            assert len(conns[1].messages) == 1  # the edit went to the new upstream socket only
            assert len(conns[0].messages) == 1


async def test_identical_twins_over_two_sockets_both_complete_when_healthy(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SCRIPT, **{"upstream.on_retry": "adaptive"}) as proxy:
        a = await connect(ws_url(proxy))
        b = await connect(ws_url(proxy))
        await a.send(create("twin", tokens=3, delay=0.01))
        await b.send(create("twin", tokens=3, delay=0.01))
        ea, eb = await asyncio.gather(events_until_end(a), events_until_end(b))
        assert ea[-1]["type"] == eb[-1]["type"] == "response.completed"
        assert text_of(ea) == text_of(eb) == "0 1 2 "
        await a.close()
        await b.close()
        await proxy.runtime.wait_idle()
        assert metric(proxy.runtime, "streamfence_supersedes_total", upstream="default") == 0
        assert metric(proxy.runtime, "streamfence_generations_total", upstream="default") == 2
        assert len(wsup.gens) == 2  # beside: each asked upstream on its own socket


async def test_identical_retry_of_a_stalled_response_supersedes_it_under_adaptive(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    overrides = {"upstream.on_retry": "adaptive", "upstream.healthy_within": 0.2}
    async with make_proxy(wsup.url, **SCRIPT, **overrides) as proxy:
        stalled = await connect(ws_url(proxy))
        await stalled.send(create("same", gated=True))
        gen1 = (await wsup.wait_gens(1))[0]
        await opening(stalled)
        await asyncio.sleep(0.3)  # the stall itself is what is tested: no event for 0.3 s
        async with connect(ws_url(proxy)) as retry:
            await retry.send(create("same"))
            assert json.loads(await stalled.recv())["code"] == "stream_superseded"
            assert (await events_until_end(retry))[-1]["type"] == "response.completed"
        assert gen1.cut
        await stalled.close()


async def test_identical_retry_of_a_response_stalled_behind_keepalives_supersedes_it(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    """The response sends OpenAI's `keepalive` events and nothing else: stalled all the same
    (proxy.wire.health, the rule HTTP follows). The identical response.create on another socket,
    right after a keep-alive, supersedes it instead of going beside a stuck twin."""
    overrides = {"upstream.on_retry": "adaptive", "upstream.healthy_within": 0.3}
    async with make_proxy(wsup.url, **SCRIPT, **overrides) as proxy:
        stalled = await connect(ws_url(proxy))
        await stalled.send(create("same", gated=True, keepalive_every=0.05))
        gen1 = (await wsup.wait_gens(1))[0]
        await opening(stalled)
        await asyncio.sleep(0.4)
        gen1.pinged.clear()
        await asyncio.wait_for(gen1.pinged.wait(), 5)  # a keep-alive, just now
        async with connect(ws_url(proxy)) as retry:
            await retry.send(create("same"))
            told = await asyncio.wait_for(past_keepalives(stalled), 5)
            assert told["code"] == "stream_superseded"
            assert (await events_until_end(retry))[-1]["type"] == "response.completed"
        assert gen1.cut and gen1.keepalives_sent >= 2
        await stalled.close()


@pytest.mark.parametrize("healthy", [True, False])
async def test_the_twin_rule_is_the_health_function_http_uses(
    wsup: WsUpstream, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch, healthy: bool
) -> None:
    """One rule: with proxy.wire.health.healthy answering `healthy` whatever the clock says, an
    identical response.create goes beside a running twin, or supersedes it."""
    monkeypatch.setattr(health, "healthy", lambda alive_at, now, within: healthy)
    overrides = {"upstream.on_retry": "adaptive", "upstream.healthy_within": 60}
    async with make_proxy(wsup.url, **SCRIPT, **overrides) as proxy:
        first = await connect(ws_url(proxy))
        await first.send(create("same", gated=True))
        gen1 = (await wsup.wait_gens(1))[0]
        await opening(first)
        async with connect(ws_url(proxy)) as second:
            await second.send(create("same"))
            assert (await events_until_end(second))[-1]["type"] == "response.completed"
            if healthy:
                gen1.release(10)
                assert (await events_until_end(first))[-1]["type"] == "response.completed"
            else:
                assert json.loads(await first.recv())["code"] == "stream_superseded"
        await first.close()
    assert metric(proxy.runtime, "streamfence_supersedes_total", upstream="default") == (
        not healthy
    )


async def test_client_leaving_mid_response_closes_upstream_and_releases(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SCRIPT) as proxy:
        ws = await connect(ws_url(proxy))
        await ws.send(create("leave", gated=True))
        gen = (await wsup.wait_gens(1))[0]
        await opening(ws)
        assert proxy.runtime.registry.live_keys() == 1
        # The status page shows the response in flight, like an HTTP stream.
        flights = proxy.runtime.status.snapshot(proxy.runtime.active)["in_flight"]
        assert [(f["dialect"], f["events"], f["attempt"]) for f in flights] == [
            ("openai-responses", 2, 1)
        ]
        await ws.close()
        await asyncio.wait_for(gen.over.wait(), 1)
        assert gen.cut
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0
        labels = {"upstream": "default", "dialect": "openai-responses", "outcome": "client_gone"}
        assert metric(proxy.runtime, "streamfence_requests_total", **labels) == 1


async def test_lanes_a_fenced_response_leaves_the_other_lane_streaming(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SUPERSEDE) as proxy:
        async with connect(ws_url(proxy)) as ws:
            lane_a = json.loads(create("a", gated=True, tokens=2, prefix="a"))
            lane_b = json.loads(create("b", gated=True, tokens=2, prefix="b"))
            await ws.send(json.dumps({**lane_a, "stream_id": "A"}))
            await ws.send(json.dumps({**lane_b, "stream_id": "B"}))
            gens = await wsup.wait_gens(2)
            for gen in gens:
                gen.release(1)
            seen: list[dict[str, Any]] = []
            while sum(e["type"] == "response.output_text.delta" for e in seen) < 2:
                seen.append(json.loads(await ws.recv()))
            async with connect(ws_url(proxy)) as other:  # the same request as lane A's
                await other.send(create("a", tokens=1, prefix="z"))
                error = json.loads(await ws.recv())
                assert error["type"] == "error" and error["code"] == "stream_superseded"
                assert error["stream_id"] == "A"
                await events_until_end(other)
            for gen in gens:
                gen.release(5)
            rest = await events_until_end(ws)
            assert {e["stream_id"] for e in rest} == {"B"}
            assert rest[-1]["type"] == "response.completed"
            assert text_of([*seen, *rest]).count("b") == 2
            assert not any(e.get("stream_id") == "A" for e in rest)
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0


@pytest.mark.parametrize(
    ("message", "code"),
    [("not json", 1003), ("[1, 2]", 1008), ('{"no": "type"}', 1008)],
)
async def test_bad_messages_close_with_a_clear_code_and_leak_nothing(
    wsup: WsUpstream, make_proxy: ProxyFactory, message: str, code: int
) -> None:
    async with make_proxy(wsup.url, **SCRIPT) as proxy:
        async with connect(ws_url(proxy)) as ws:
            await ws.send(create("ok", tokens=1))
            assert (await events_until_end(ws))[-1]["type"] == "response.completed"
            await ws.send(create("pending", gated=True))
            gen = (await wsup.wait_gens(2))[1]
            await ws.send(message)
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == code
            assert closed.value.rcvd.reason.startswith("streamfence:")
        await asyncio.wait_for(gen.over.wait(), 1)
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0
        assert message not in (await wsup.wait_conns(1))[0].messages


async def test_unknown_message_type_reaches_the_upstream(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SCRIPT) as proxy, connect(ws_url(proxy)) as ws:
        await ws.send(json.dumps({"type": "response.future_thing"}))
        answer = json.loads(await ws.recv())
        assert answer["type"] == "error" and answer["error"]["code"] == "unknown_event_type"
        await ws.send(create(tokens=1))
        assert (await events_until_end(ws))[-1]["type"] == "response.completed"


async def test_client_that_never_reads_is_dropped_and_leaks_nothing(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SCRIPT, **{"server.write_timeout": 0.4}) as proxy:
        ws = await connect(ws_url(proxy), max_queue=1, max_size=None, compression=None)
        # 26 MB that does not compress (a 64 KiB token repeats beyond deflate's window): more
        # than every buffer on the way holds.
        await ws.send(create("big", tokens=400, prefix=secrets.token_hex(32768)))
        gen = (await wsup.wait_gens(1))[0]
        await asyncio.wait_for(gen.over.wait(), 10)
        assert gen.cut and not gen.finished
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0
        labels = {"upstream": "default", "dialect": "openai-responses", "outcome": "client_gone"}
        assert metric(proxy.runtime, "streamfence_requests_total", **labels) == 1
        ws.transport.abort()


async def test_a_queued_response_behind_a_fenced_one_is_sent_again_on_the_new_socket(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SUPERSEDE) as proxy:
        async with connect(ws_url(proxy)) as ws:
            await ws.send(create("first", gated=True, tokens=2, prefix="a"))
            await ws.send(create("queued behind it", tokens=2, prefix="q"))  # same lane: waits
            gen1 = (await wsup.wait_gens(1))[0]
            await opening(ws)
            async with connect(ws_url(proxy)) as other:
                await other.send(create("first", tokens=1, prefix="z"))
                error = json.loads(await ws.recv())
                assert error["type"] == "error" and error["code"] == "stream_superseded"
                await events_until_end(other)
            events = await events_until_end(ws)
            assert text_of(events) == "q0 q1 " and events[-1]["type"] == "response.completed"
            assert gen1.cut
            conns = await wsup.wait_conns(3)
            queued = [c for c in conns if any("queued" in str(m) for m in c.messages)]
            assert len(queued) == 2  # sent on the first upstream socket, then again on the new
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0


async def test_shutdown_ends_a_running_response_with_an_error_and_closes_1001(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SCRIPT) as proxy:
        ws = await connect(ws_url(proxy))
        await ws.send(create("long", gated=True))
        gen = (await wsup.wait_gens(1))[0]
        await opening(ws)
        for attempt in list(proxy.runtime.active):  # what the shutdown drain does at its deadline
            attempt.abort(ShuttingDown("streamfence: the proxy is shutting down"))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["code"] == "shutting_down"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        await asyncio.wait_for(gen.over.wait(), 1)
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0
        labels = {"upstream": "default", "dialect": "openai-responses", "outcome": "shutdown"}
        assert metric(proxy.runtime, "streamfence_requests_total", **labels) == 1


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
async def test_redis_registry_fences_a_websocket_response_from_another_proxy(
    wsup: WsUpstream, upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    with running_redis() as server:
        shared = {"registry.backend": "redis", "registry.url": server.url}
        async with (
            make_proxy(wsup.url, **SCRIPT, **shared) as over_ws,
            make_proxy(upstream.url, **shared) as over_http,
        ):
            for p in (over_ws, over_http):
                await asyncio.wait_for(p.runtime.registry.wait_subscribed(), 5)  # type: ignore[attr-defined]
            turn = {"X-Turn-Id": "shared-turn", "Authorization": "Bearer sk-1"}
            ws = await connect(ws_url(over_ws), additional_headers=turn)
            await ws.send(create("on proxy one", gated=True))
            gen = (await wsup.wait_gens(1))[0]
            await opening(ws)
            async with httpx.AsyncClient(base_url=over_http.url, timeout=10) as http:
                body = {"model": "m", "input": "on proxy two", "stream": True}
                r = await http.post("/v1/responses", json=body, headers=turn)
                assert r.status_code == 200 and "response.completed" in r.text
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["code"] == "stream_superseded"
            await asyncio.wait_for(gen.over.wait(), 1)
            assert gen.cut
            await ws.close()
            await over_ws.runtime.wait_idle()


async def test_upstream_dropping_the_connection_closes_the_client_1014(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SCRIPT) as proxy, connect(ws_url(proxy)) as ws:
        await ws.send(create("cut", abort=True))
        assert json.loads(await ws.recv())["type"] == "response.created"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1014
        await proxy.runtime.wait_idle()
        labels = {"upstream": "default", "dialect": "openai-responses", "outcome": "upstream_error"}
        assert metric(proxy.runtime, "streamfence_requests_total", **labels) == 1
        assert proxy.runtime.registry.live_keys() == 0


async def test_upstream_refusing_the_reopen_after_a_fence_closes_the_client_1014(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(wsup.url, **SUPERSEDE) as proxy, connect(ws_url(proxy)) as ws:
        await ws.send(create("one", gated=True))
        await wsup.wait_gens(1)
        await opening(ws)
        async with connect(ws_url(proxy)) as other:
            await other.send(create("one", tokens=1))
            assert json.loads(await ws.recv())["code"] == "stream_superseded"
            await events_until_end(other)
        wsup.refuse = (503, {}, b"down")
        await ws.send(create("next", tokens=1))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1014
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0


async def test_registry_unavailable_fail_closed_answers_the_response_and_closes_1013(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    dead = {
        "registry.backend": "redis",
        "registry.url": f"redis://127.0.0.1:{free_port()}/0",
        "registry.on_unavailable": "fail_closed",
    }
    async with make_proxy(wsup.url, **SCRIPT, **dead) as proxy, connect(ws_url(proxy)) as ws:
        await ws.send(create("needs a lease"))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["code"] == "registry_unavailable"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
        assert wsup.gens == []  # nothing went upstream unfenced
