"""The single-writer invariant at the proxy level, mirroring ../shared/seed/.

Real uvicorn on loopback, a real HTTP client, a scripted upstream that is a real server.
Synchronisation is by events (the upstream's gates and `closed`), never by sleeping.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from tests.conftest import Proxy, ProxyFactory
from tests.scripted import ScriptedUpstream
from tests.sse_client import Event, chat_body, events, open_stream
from tests.stress import harness

CHAT = "/v1/chat/completions"


async def _drain(response: httpx.Response) -> list[Event]:
    return [e async for e in events(response)]


def _assert_superseded_frame(event: Event) -> None:
    body = event.json
    assert body["error"]["code"] == "stream_superseded"
    assert list(body) == ["error"]  # no choices, no chunk fields
    assert "[DONE]" not in event.data


async def test_superseded_writer_gets_nothing_after_the_newer_attempt(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    """Seed: test_superseded_writer_deltas_are_dropped."""
    async with proxy.client() as client, AsyncExitStack() as stack:
        a = await open_stream(
            stack, client, CHAT, chat_body(gated=True, prefix="A"), {"X-Turn-Id": "turn-1"}
        )
        a_events = events(a)
        first = await anext(a_events)
        assert first.text == "A0 "
        seen_a = (await upstream.wait_requests(1))[0]

        b = await open_stream(
            stack, client, CHAT, chat_body(prefix="B", tokens=3), {"X-Turn-Id": "turn-1"}
        )
        assert b.headers["x-streamfence-attempt"] == "2"
        # B's headers mean B was accepted: from here on A may receive nothing but the frame.
        seen_a.release(10)  # even if A's upstream were still alive, nothing may pass
        rest_a = [e async for e in a_events]
        b_events = await _drain(b)

    assert len(rest_a) == 1, rest_a
    _assert_superseded_frame(rest_a[0])
    assert "".join(e.text for e in b_events) == "B0 B1 B2 "
    assert b_events[-1].data == "[DONE]"
    assert a.headers["x-streamfence-attempt"] == "1"
    assert a.headers["x-streamfence-turn"] == b.headers["x-streamfence-turn"]


async def test_consume_loop_stops_the_moment_it_is_superseded(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    """Seed: test_consume_loop_stops_when_superseded_mid_stream, plus: nothing is drained."""
    async with proxy.client() as client, AsyncExitStack() as stack:
        a = await open_stream(
            stack, client, CHAT, chat_body(gated=True, tokens=50, prefix="A"), {"X-Turn-Id": "t"}
        )
        a_events = events(a)
        assert (await anext(a_events)).text == "A0 "
        seen_a = upstream.seen[0]
        await client.post(CHAT, json=chat_body(stream=False), headers={"X-Turn-Id": "t"})
        await seen_a.closed.wait()
        rest = [e async for e in a_events]
    # The upstream was closed while it waited to produce its second event: it never did.
    assert seen_a.events_sent == 1
    assert not seen_a.finished
    assert [e.json["error"]["code"] for e in rest] == ["stream_superseded"]


async def test_current_attempt_is_never_fenced(proxy: Proxy, upstream: ScriptedUpstream) -> None:
    """Seed: test_current_writer_is_never_fenced. Also: the attempt number restarts once
    the key has no live attempt, and a finished turn does not fence its next request."""
    async with proxy.client() as client:
        for _ in range(2):
            async with client.stream(
                "POST", CHAT, json=chat_body(tokens=4, delay=0.001), headers={"X-Turn-Id": "k"}
            ) as r:
                got = await _drain(r)
            assert r.headers["x-streamfence-attempt"] == "1"
            assert "".join(e.text for e in got) == "0 1 2 3 "
            assert got[-1].data == "[DONE]"
            assert not any(e.is_error for e in got)
    await proxy.runtime.wait_idle()
    assert proxy.runtime.registry.live_keys() == 0


async def test_requests_without_a_key_never_fence_or_get_fenced(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    """Seed: test_non_claiming_thread_is_not_a_writer."""
    async with proxy.client() as client, AsyncExitStack() as stack:
        # A keyed turn in flight, then two keyless requests: opted out, and not JSON.
        keyed = await open_stream(
            stack, client, CHAT, chat_body(gated=True, prefix="K"), {"X-Turn-Id": "same"}
        )
        keyed_events = events(keyed)
        await anext(keyed_events)
        opted_out = [
            await open_stream(
                stack, client, CHAT, chat_body(gated=True, prefix="A"), {"X-Turn-Id": "none"}
            )
            for _ in range(2)
        ]
        not_json = await client.post(CHAT, content=b"not json {", headers={"X-Turn-Id": "NONE"})
        assert not_json.status_code == 200
        assert "x-streamfence-attempt" not in not_json.headers
        for seen in await upstream.wait_requests(4):
            seen.release(10)
        outcomes = [await _drain(r) for r in opted_out]
        keyed_rest = [e async for e in keyed_events]
    for got in outcomes:
        assert "".join(e.text for e in got) == "A0 A1 A2 "
        assert got[-1].data == "[DONE]"
    assert "".join(e.text for e in keyed_rest) == "K1 K2 "
    assert all("x-streamfence-attempt" not in r.headers for r in opted_out)


@pytest.mark.parametrize("policy", ["supersede", "adaptive"])
async def test_identical_retry_without_header_is_keyed_by_fingerprint(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream, policy: str
) -> None:
    """The same turn by fingerprint: under supersede the retry fences the first attempt;
    under adaptive it does so once the first has stalled (here: at once)."""
    options = {"upstream.on_retry": policy, "upstream.healthy_within": 0.0}
    body = chat_body(gated=True, tokens=5)
    async with (
        make_proxy(upstream.url, **options) as proxy,
        proxy.client() as client,
        AsyncExitStack() as stack,
    ):
        a = await open_stream(stack, client, CHAT, body)
        a_events = events(a)
        await anext(a_events)
        retry = {**body, "stream_options": {"include_usage": True}}  # volatile: ignored
        b = await open_stream(stack, client, CHAT, retry)
        assert b.headers["x-streamfence-attempt"] == "2"
        rest = [e async for e in a_events]
        upstream.seen[1].release(10)
        b_events = await _drain(b)
    _assert_superseded_frame(rest[-1])
    assert len(rest) == 1
    assert "".join(e.text for e in b_events) == "0 1 2 3 4 "


async def test_next_turn_and_other_credentials_do_not_fence(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    async with proxy.client() as client, AsyncExitStack() as stack:
        a = await open_stream(
            stack,
            client,
            CHAT,
            chat_body(gated=True, prefix="A"),
            {"X-Turn-Id": "shared", "Authorization": "Bearer key-one"},
        )
        a_events = events(a)
        await anext(a_events)
        # The same turn id under another key, and a longer conversation (the next turn).
        other_key = await client.post(
            CHAT,
            json=chat_body(stream=False),
            headers={"X-Turn-Id": "shared", "Authorization": "Bearer key-two"},
        )
        next_turn = chat_body(gated=True, prefix="A")
        next_turn["messages"].append({"role": "assistant", "content": "more"})
        await client.post(
            CHAT, json={**next_turn, "stream": False}, headers={"Authorization": "Bearer key-one"}
        )
        upstream.seen[0].release(10)
        rest = [e async for e in a_events]
    assert other_key.status_code == 200
    assert other_key.headers["x-streamfence-attempt"] == "1"
    assert "".join(e.text for e in rest) == "A1 A2 "
    assert rest[-1].data == "[DONE]"


async def test_superseded_before_headers_gets_409_and_upstream_closed(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    async with proxy.client() as client:
        a_task = asyncio.create_task(
            client.post(CHAT, json=chat_body(hold_headers=True), headers={"X-Turn-Id": "h"})
        )
        seen_a = (await upstream.wait_requests(1))[0]  # A waits for upstream headers
        b = await client.post(CHAT, json=chat_body(stream=False), headers={"X-Turn-Id": "h"})
        a = await a_task
        await seen_a.closed.wait()
    assert b.status_code == 200
    assert a.status_code == 409
    assert a.headers["x-should-retry"] == "false"
    assert a.json()["error"]["code"] == "stream_superseded"
    assert seen_a.events_sent == 0


@pytest.mark.parametrize("transport", ["fast", "httpx"])
async def test_a_fence_before_headers_closes_the_upstream_before_the_409_goes_out(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream, transport: str
) -> None:
    # The fence's promise: the old upstream request is closed, then the client is told.
    # Its latency (newer claim -> upstream closed) is recorded for the superseded request.
    options = {"server.http_transport": transport}
    async with make_proxy(upstream.url, **options) as proxy, proxy.client() as client:
        watch = harness.watch(proxy.runtime)
        a_task = asyncio.create_task(
            client.post(CHAT, json=chat_body(hold_headers=True), headers={"X-Turn-Id": "h"})
        )
        seen_a = (await upstream.wait_requests(1))[0]  # A waits for upstream headers
        b = await client.post(CHAT, json=chat_body(stream=False), headers={"X-Turn-Id": "h"})
        a = await a_task
        records = await harness.settled(proxy.runtime, 2)
        await asyncio.wait_for(seen_a.closed.wait(), 5)
    assert (a.status_code, b.status_code) == (409, 200)
    (fenced,) = [r for r in records if r.outcome == "superseded"]
    assert fenced.status == 409
    assert fenced.fence_latency is not None and 0.0 <= fenced.fence_latency < 1.0
    # Its time to first byte (the log's ttfb_ms, the status page's) is when the 409 went out.
    assert fenced.ttfb is not None and 0.0 < fenced.ttfb <= fenced.duration
    assert watch.records == records


async def test_client_leaving_before_headers_closes_the_upstream(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    async with proxy.client() as client:
        task = asyncio.create_task(client.post(CHAT, json=chat_body(hold_headers=True)))
        seen = (await upstream.wait_requests(1))[0]
        task.cancel()
        await seen.closed.wait()
    assert seen.events_sent == 0
    await proxy.runtime.wait_idle()
    assert proxy.runtime.registry.live_keys() == 0


async def test_client_leaving_mid_stream_closes_the_upstream(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    async with proxy.client() as client:
        async with client.stream("POST", CHAT, json=chat_body(gated=True, tokens=9)) as r:
            await anext(events(r))
        seen = upstream.seen[0]
        await seen.closed.wait()
    assert seen.events_sent == 1
    await proxy.runtime.wait_idle()
    assert proxy.runtime.registry.live_keys() == 0


@pytest.mark.parametrize(
    ("path", "check"),
    [
        (
            "/v1/chat/completions",
            lambda e: (
                e.event is None
                and list(e.json) == ["error"]
                and e.json["error"]["code"] == "stream_superseded"
            ),
        ),
        (
            "/v1/responses",
            lambda e: (
                e.event == "error"
                and e.json["type"] == "error"
                and e.json["code"] == "stream_superseded"
                and e.json["sequence_number"] == 1
            ),
        ),
        (
            "/v1/messages",
            lambda e: e.event == "error" and e.json["error"]["type"] == "stream_superseded",
        ),
        (
            "/v1beta/models/g:streamGenerateContent",
            lambda e: (
                e.event is None  # data-only: google-genai cannot parse an event: line
                and e.json["error"]["status"] == "ABORTED"
                and e.json["error"]["code"] == 409
            ),
        ),
        ("/v1/some/other/stream", lambda e: e.event == "error" and e.json["error"]["code"] == 409),
    ],
)
async def test_each_dialect_ends_a_fenced_stream_with_its_own_frame(
    proxy: Proxy, upstream: ScriptedUpstream, path: str, check: Any
) -> None:
    async with proxy.client() as client, AsyncExitStack() as stack:
        a = await open_stream(
            stack, client, path + "?alt=sse", chat_body(gated=True), {"X-Turn-Id": "d"}
        )
        a_events = events(a)
        await anext(a_events)
        await client.post(path, json=chat_body(stream=False), headers={"X-Turn-Id": "d"})
        rest = [e async for e in a_events]
    assert len(rest) == 1 and check(rest[0]), rest
    assert "superseded" in rest[0].data
    for terminator in ("[DONE]", "response.completed", "message_stop"):
        assert terminator not in rest[0].data
