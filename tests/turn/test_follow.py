"""Generations and followers (CONTRACT section 3) end to end: real uvicorn, real clients,
a scripted upstream. An identical request follows a healthy generation, supersedes a stalled
one, goes beside it in the other streaming mode; followers never fence; the last client
closes the upstream; Last-Event-ID resumes; the caps fall back to a new generation."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest

from proxy.wire import health
from tests.conftest import Proxy, ProxyFactory
from tests.probes import metric
from tests.scripted import Script, ScriptedUpstream
from tests.sse_client import Event, chat_body, events, events_of_a_cut_body, open_stream
from tests.stress import harness

CHAT = "/v1/chat/completions"
TURN = {"X-Turn-Id": "follow-turn"}
HEALTHY = {"upstream.healthy_within": 3600.0}


@asynccontextmanager
async def replaying(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream, window: float = 60.0
) -> AsyncIterator[tuple[Proxy, httpx.AsyncClient]]:
    """A proxy that keeps finished answers `window` seconds for replays, and a client of it."""
    async with (
        make_proxy(upstream.url, **{"upstream.replay_window": window}) as proxy,
        proxy.client() as client,
    ):
        yield proxy, client


STALLED = {"upstream.healthy_within": 0.0}


async def _text(response: httpx.Response) -> tuple[str, list[Event]]:
    got = [e async for e in events(response)]
    return "".join(e.text for e in got), got


def _codes(got: list[Event]) -> list[str]:
    return [e.json["error"]["code"] for e in got if e.is_error]


async def test_identical_twins_share_one_generation(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    body = chat_body(gated=True, tokens=5, prefix="T")
    async with make_proxy(upstream.url, **HEALTHY) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            a = await open_stream(stack, client, CHAT, body)
            a_events = events(a)
            assert (await anext(a_events)).text == "T0 "
            b = await open_stream(stack, client, CHAT, body)  # no turn id: the fingerprint
            assert (b.headers["x-streamfence-source"], b.headers["x-streamfence-attempt"]) == (
                "followed",
                "1",
            )
            upstream.seen[0].release(10)
            a_rest = [e async for e in a_events]
            b_text, b_events = await _text(b)
        await proxy.runtime.wait_idle()
        assert len(upstream.seen) == 1  # asked upstream once
        assert "".join(e.text for e in a_rest) == "T1 T2 T3 T4 "
        assert b_text == "T0 T1 T2 T3 T4 "  # everything so far, then live, in order
        assert b_events[-1].data == "[DONE]" and not _codes(a_rest + b_events)
        assert (
            metric(proxy.runtime, "streamfence_follows_total", upstream="default", how="followed")
            == 1
        )
        assert (
            metric(proxy.runtime, "streamfence_upstream_requests_saved_total", upstream="default")
            == 1
        )
        assert metric(proxy.runtime, "streamfence_generations_total", upstream="default") == 1
        assert len(proxy.runtime.generations or ()) == 0
        assert proxy.runtime.budget.used == 0


async def test_a_stalled_generation_is_superseded_and_all_its_clients_fenced(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    body = chat_body(gated=True, tokens=3, prefix="S")
    async with make_proxy(upstream.url, **STALLED, **{"upstream.on_retry": "adaptive"}) as proxy:
        async with proxy.client() as client, AsyncExitStack() as stack:
            a = await open_stream(stack, client, CHAT, body, TURN)
            a_events = events(a)
            await anext(a_events)
            b = await open_stream(stack, client, CHAT, body, TURN)
            assert b.headers["x-streamfence-attempt"] == "2"
            assert b.headers["x-streamfence-source"] == "upstream"
            a_rest = [e async for e in a_events]
            await upstream.seen[0].closed.wait()  # closed, not drained
            upstream.seen[1].release(10)
            b_text, _ = await _text(b)
    assert len(upstream.seen) == 2
    assert _codes(a_rest) == ["stream_superseded"] and len(a_rest) == 1
    assert b_text == "S0 S1 S2 "


async def test_a_generation_stays_healthy_while_its_upstream_sends_events(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    # Health is measured from the later of the request, the headers and the last content
    # event: a stream that keeps sending stays healthy long past `healthy_within` after its
    # request, and an identical request then follows it (one upstream request, no fence).
    window = 1.0
    body = chat_body(gated=True, tokens=60, prefix="L")
    options = {"upstream.healthy_within": window}
    async with make_proxy(upstream.url, **options) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            a = await open_stream(stack, client, CHAT, body, TURN)
            a_events = events(a)
            await anext(a_events)
            gen = upstream.seen[0]
            since = time.monotonic()
            while time.monotonic() - since < 2.5 * window:
                await asyncio.sleep(window / 5)  # the pace of a live stream, in its own time
                gen.release(1)
                await anext(a_events)
            b = await open_stream(stack, client, CHAT, body, TURN)
            assert b.headers["x-streamfence-source"] == "followed"
            gen.release(100)
            a_rest = [e async for e in a_events]
            b_text, b_events = await _text(b)
    assert len(upstream.seen) == 1 and not _codes(a_rest + b_events)
    assert b_text == "".join(f"L{i} " for i in range(60))


async def test_a_generation_is_alive_from_its_response_headers(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The upstream sends its headers late, then nothing yet: a twin arriving now finds the
    # generation alive as of its headers, not of its request. (The one health function,
    # told to judge by that, stands in for a clock and a window.)
    held = Script(hold_headers=True, gated_after_tokens=0, tokens=2, prefix="H")
    upstream.queue.extend([held, Script(tokens=2, prefix="B")])  # B: a new generation's
    body = chat_body()
    async with make_proxy(upstream.url, **HEALTHY) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            opening = asyncio.create_task(open_stream(stack, client, CHAT, body, TURN))
            (gen,) = await asyncio.wait_for(upstream.wait_requests(1), 5)
            released = time.monotonic()
            gen.release(1)  # its headers; each event waits for one more
            a = await asyncio.wait_for(opening, 5)
            monkeypatch.setattr(
                health, "healthy", lambda alive_at, now, within: alive_at >= released
            )
            b = await open_stream(stack, client, CHAT, body, TURN)
            gen.release(10)
            a_text, _ = await _text(a)
            b_text, _ = await _text(b)
    assert b.headers["x-streamfence-source"] == "followed" and len(upstream.seen) == 1
    assert a_text == b_text == "H0 H1 "


async def test_join_follows_even_a_stalled_generation(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    options = {"upstream.on_retry": "join", **STALLED}
    body = chat_body(gated=True, tokens=3, prefix="J")
    async with make_proxy(upstream.url, **options) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            a = await open_stream(stack, client, CHAT, body, TURN)
            await anext(events(a))
            b = await open_stream(stack, client, CHAT, body, TURN)
            upstream.seen[0].release(10)
            b_text, _ = await _text(b)
    assert len(upstream.seen) == 1
    assert b_text == "J0 J1 J2 "


async def test_supersede_policy_fences_every_repeat(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    options = {"upstream.on_retry": "supersede", **HEALTHY}
    body = chat_body(gated=True, tokens=2, prefix="P")
    async with make_proxy(upstream.url, **options) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            a = await open_stream(stack, client, CHAT, body, TURN)
            a_events = events(a)
            await anext(a_events)
            b = await open_stream(stack, client, CHAT, body, TURN)
            a_rest = [e async for e in a_events]
            upstream.seen[1].release(10)
            b_text, _ = await _text(b)
        await proxy.runtime.wait_idle()
        # Once the retry has answered, the same request again is a new question, not a
        # stale repeat of a version some newer one replaced: repeats are never refused here.
        again = await client.post(CHAT, json={**body, "stream": False}, headers=TURN)
    assert _codes(a_rest) == ["stream_superseded"]
    assert b_text == "P0 P1 " and again.status_code == 200 and len(upstream.seen) == 3


async def test_a_different_body_under_one_turn_id_fences_the_generation_and_its_followers(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    body = chat_body(gated=True, tokens=4, prefix="A")
    async with make_proxy(upstream.url, **HEALTHY) as proxy, proxy.client() as client:
        harness.watch(proxy.runtime)
        async with AsyncExitStack() as stack:
            first = await open_stream(stack, client, CHAT, body, TURN)
            first_events = events(first)
            await anext(first_events)
            follower = await open_stream(stack, client, CHAT, body, TURN)
            follower_events = events(follower)
            await anext(follower_events)
            changed = chat_body(prompt="changed", tokens=2, prefix="B")
            newer = await open_stream(stack, client, CHAT, changed, TURN)
            first_rest = [e async for e in first_events]
            follower_rest = [e async for e in follower_events]
            newer_text, _ = await _text(newer)
        records = await harness.settled(proxy.runtime, 3)
    assert _codes(first_rest) == ["stream_superseded"] and len(first_rest) == 1
    assert _codes(follower_rest) == ["stream_superseded"] and len(follower_rest) == 1
    assert newer_text == "B0 B1 " and len(upstream.seen) == 2
    assert upstream.seen[0].closed.is_set()
    # One upstream request was fenced: one fence latency (the log's, the metric's), that of
    # the request that went upstream; its follower's record has none.
    assert [r.source for r in records if r.fence_latency is not None] == ["upstream"]
    assert sorted(r.source for r in records if r.outcome == "superseded") == [
        "followed",
        "upstream",
    ]


async def test_a_non_streaming_twin_goes_beside_a_healthy_stream(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    body = chat_body(gated=True, tokens=3, prefix="M")
    async with make_proxy(upstream.url, **HEALTHY) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            streaming = await open_stream(stack, client, CHAT, body, TURN)
            stream_events = events(streaming)
            await anext(stream_events)
            whole = await client.post(CHAT, json={**body, "stream": False}, headers=TURN)
            # The stream is still the turn's generation to follow: the one beside it is not.
            twin = await open_stream(stack, client, CHAT, body, TURN)
            assert twin.headers["x-streamfence-source"] == "followed"
            upstream.seen[0].release(10)
            rest = [e async for e in stream_events]
            twin_text, _ = await _text(twin)
    assert whole.headers["content-type"] == "application/json"
    assert whole.headers["x-streamfence-source"] == "beside"
    assert whole.json()["choices"][0]["message"]["content"] == "M0 M1 M2 "
    assert "".join(e.text for e in rest) == "M1 M2 " and not _codes(rest)
    assert twin_text == "M0 M1 M2 "
    assert len(upstream.seen) == 2


async def test_a_non_streaming_retry_of_a_stalled_stream_supersedes_it(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    body = chat_body(gated=True, tokens=3, prefix="N")
    async with make_proxy(upstream.url, **STALLED) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            streaming = await open_stream(stack, client, CHAT, body, TURN)
            stream_events = events(streaming)
            await anext(stream_events)
            whole = await client.post(CHAT, json={**body, "stream": False}, headers=TURN)
            rest = [e async for e in stream_events]
    assert whole.status_code == 200 and whole.json()["choices"][0]["message"]["content"]
    assert _codes(rest) == ["stream_superseded"]


async def test_a_follower_leaving_keeps_the_generation_and_the_last_one_closes_it(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    body = chat_body(gated=True, tokens=9, prefix="L")
    async with make_proxy(upstream.url, **HEALTHY) as proxy, proxy.client() as client:
        async with AsyncExitStack() as outer:
            a = await open_stream(outer, client, CHAT, body, TURN)
            a_events = events(a)
            await anext(a_events)
            async with client.stream("POST", CHAT, json=body, headers=TURN) as b:
                await anext(events(b))
            upstream.seen[0].release(1)
            assert (await anext(a_events)).text == "L1 "  # still streaming for the first
            assert not upstream.seen[0].closed.is_set()
        await upstream.seen[0].closed.wait()  # the last client left: the upstream is closed
        await proxy.runtime.wait_idle()
        assert upstream.seen[0].events_sent == 2
        assert len(proxy.runtime.generations or ()) == 0
        assert proxy.runtime.registry.live_keys() == 0


async def test_an_upstream_failure_is_counted_once_however_many_clients_it_reached(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    # Both clients get the error event; the failure is its generation's, one upstream
    # request's: the first client reports it, its follower does not again.
    body = chat_body(gated=True, tokens=5, fail_after=2, prefix="F")
    async with make_proxy(upstream.url, **HEALTHY) as proxy, proxy.client() as client:
        harness.watch(proxy.runtime)
        async with AsyncExitStack() as stack:
            first = await open_stream(stack, client, CHAT, body, TURN)
            first_events = events(first)
            await anext(first_events)
            follower = await open_stream(stack, client, CHAT, body, TURN)
            assert follower.headers["x-streamfence-source"] == "followed"
            upstream.seen[0].release(10)
            first_rest: list[Event] = []
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                async for event in first_events:  # cut, after the error event
                    first_rest.append(event)
            assert _codes(first_rest) == ["upstream_error"]
            assert _codes(await events_of_a_cut_body(follower)) == ["upstream_error"]
        records = await harness.settled(proxy.runtime, 2)
        errors = proxy.runtime.metrics.registry.get_sample_value(
            "streamfence_upstream_errors_total", {"upstream": "default", "kind": "protocol"}
        )
    assert sorted(r.outcome for r in records) == ["upstream_error", "upstream_error"]
    assert errors == 1


SSE_PATH = "/v1/events"  # no LLM dialect: the proxy stamps its own event ids


def _ids(got: str) -> list[str]:
    return [line[4:] for line in got.splitlines() if line.startswith("id: ")]


async def test_last_event_id_resumes_a_running_generation_and_bad_ones_are_ignored(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    upstream.default = Script(stream=True, gated=True, tokens=4, prefix="E")
    async with make_proxy(upstream.url, **HEALTHY) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(client.stream("GET", SSE_PATH, headers=TURN))
            lines = a.aiter_lines()
            raw = ""
            while "id: " not in raw:
                raw += await anext(lines) + "\n"
            (first_id,) = _ids(raw)
            token = first_id.split("-")[0]
            cases = {
                "own": first_id,
                "not-a-number": "abc",
                "huge": f"{token}-99999999999999999999",
                "other-generation": f"{int(token) + 7}-1",
            }
            followers = {
                name: await stack.enter_async_context(
                    client.stream("GET", SSE_PATH, headers={**TURN, "Last-Event-ID": last})
                )
                for name, last in cases.items()
            }
            upstream.seen[0].release(10)
            results = {
                name: (r.headers["x-streamfence-source"], (await r.aread()).count(b"data: {"))
                for name, r in followers.items()
            }
    assert len(upstream.seen) == 1
    assert "last-event-id" not in upstream.seen[0].headers  # ids are the proxy's own
    # Four token chunks and the finish chunk: the resumed client gets all after its first.
    assert results["own"] == ("resumed", 4)
    for name in ("not-a-number", "huge", "other-generation"):
        assert results[name] == ("followed", 5), name  # served from the start


async def test_where_the_proxy_stamps_no_ids_a_last_event_id_resumes_nothing(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    # event_ids = "never": the ids a client holds are the upstream's own. One that reads as
    # the proxy's id of an event the running generation holds is not one: the follower is
    # served from the start.
    upstream.default = Script(stream=True, gated=True, tokens=4, prefix="N")
    options = {**HEALTHY, "upstream.event_ids": "never"}
    async with make_proxy(upstream.url, **options) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(client.stream("GET", SSE_PATH, headers=TURN))
            assert (await anext(events(a))).text == "N0 "
            assert proxy.runtime.generations is not None
            (generation,) = proxy.runtime.generations._live.values()
            lookalike = {**TURN, "Last-Event-ID": f"{generation.token}-1"}
            b = await stack.enter_async_context(client.stream("GET", SSE_PATH, headers=lookalike))
            upstream.seen[0].release(10)
            got = await b.aread()
    assert len(upstream.seen) == 1 and b"id: " not in got
    assert (b.headers["x-streamfence-source"], got.count(b"data: {")) == ("followed", 5)


async def test_eventsource_style_get_names_its_turn_in_the_query_and_stops_at_the_end(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    upstream.default = Script(stream=True, tokens=2, prefix="Q")
    url = f"{SSE_PATH}?topic=x&streamfence_turn=tab-1"
    async with make_proxy(upstream.url, **HEALTHY) as proxy, proxy.client() as client:
        first = await client.get(url)
        last = _ids(first.text)[-1]
        again = await client.get(url, headers={"Last-Event-ID": last})
        fresh = await client.get(url, headers={"Last-Event-ID": "1-1"})
        plain = await client.get(url)  # no Last-Event-ID at all: a new start
    assert upstream.seen[0].query == "topic=x"  # the turn parameter is the proxy's
    assert first.headers["x-streamfence-source"] == "upstream"
    assert again.status_code == 204 and again.content == b""  # EventSource: stop reconnecting
    assert fresh.status_code == 200 and plain.status_code == 200 and len(upstream.seen) == 3


async def test_an_eventsource_reconnecting_after_a_cut_stream_gets_a_new_answer(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    # The upstream broke the stream: its last id is not the end of an answer, so a
    # reconnect from it is not told that nothing is left (204 would stop an EventSource).
    upstream.queue.append(Script(stream=True, tokens=4, prefix="C", fail_after=2))
    upstream.default = Script(stream=True, tokens=2, prefix="N")
    url = f"{SSE_PATH}?streamfence_turn=tab-2"
    async with make_proxy(upstream.url, **HEALTHY) as proxy, proxy.client() as client:
        cut = ""
        async with client.stream("GET", url) as r:
            # Cut downstream too, after the error event (CONTRACT section 5).
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                async for text in r.aiter_text():
                    cut += text
        await proxy.runtime.wait_idle()
        again = await client.get(url, headers={"Last-Event-ID": _ids(cut)[-1]})
    assert "C1 " in cut and "C2 " not in cut
    assert again.status_code == 200 and "N1 " in again.text and len(upstream.seen) == 2


async def test_the_proxys_event_id_wins_over_the_upstreams(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    upstream.default = Script(stream=True, raw=["id: 99\ndata: one\n\n", "id: 98\ndata: two\n\n"])
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        got = await client.get(SSE_PATH, headers=TURN)
    blocks = [b for b in got.text.split("\n\n") if b]
    last_ids = [_ids(b)[-1] for b in blocks]  # a client keeps the last id line of an event
    token = last_ids[0].split("-")[0]
    assert last_ids == [f"{token}-1", f"{token}-2"]


async def test_a_request_without_a_turn_keeps_the_upstreams_ids_and_its_last_event_id(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    # No turn id and no body to fingerprint: the request takes no part in fencing, so the
    # ids and the resume point are the upstream's business, as without the proxy.
    upstream.default = Script(stream=True, raw=["id: 99\ndata: one\n\n"])
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        got = await client.get(SSE_PATH, headers={"Last-Event-ID": "98"})
        await proxy.runtime.wait_idle()
        started = metric(proxy.runtime, "streamfence_generations_total", upstream="default")
    assert _ids(got.text) == ["99"]
    assert upstream.seen[0].headers["last-event-id"] == "98"
    assert started == 1


async def test_replay_after_completion_needs_an_explicit_turn_id(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    body = chat_body(tokens=3, prefix="R")
    async with replaying(make_proxy, upstream) as (proxy, client):
        first = await client.post(CHAT, json=body, headers=TURN)
        again = await client.post(CHAT, json=body, headers=TURN)
        assert len(upstream.seen) == 1  # replayed from memory
        assert again.text == first.text and again.headers["x-streamfence-source"] == "replayed"
        await proxy.runtime.wait_idle()
        assert (
            metric(proxy.runtime, "streamfence_follows_total", upstream="default", how="replayed")
            == 1
        )
        # Keyed by fingerprint only: an identical body may be a deliberate regeneration.
        await client.post(CHAT, json=chat_body(tokens=2, prefix="F"))
        await client.post(CHAT, json=chat_body(tokens=2, prefix="F"))
        assert len(upstream.seen) == 3


async def test_a_replay_is_only_ever_of_the_same_streaming_mode(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    # A non-streaming fallback of a streamed turn that completed: never a replayed stream
    # (an SDK that asked for JSON cannot read SSE), a new answer from upstream.
    body = chat_body(tokens=3, prefix="R")
    async with replaying(make_proxy, upstream) as (proxy, client):
        streamed = await client.post(CHAT, json=body, headers=TURN)
        whole = await client.post(CHAT, json={**body, "stream": False}, headers=TURN)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert whole.headers["x-streamfence-source"] == "upstream" and len(upstream.seen) == 2
    assert whole.headers["content-type"] == "application/json"
    assert whole.json()["choices"][0]["message"]["content"] == "R0 R1 R2 "


async def test_a_non_streaming_answer_is_replayed_too(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    # A whole JSON body read to its end is a completed answer like a stream's.
    body = {**chat_body(tokens=3, prefix="J"), "stream": False}
    async with replaying(make_proxy, upstream) as (proxy, client):
        first = await client.post(CHAT, json=body, headers=TURN)
        again = await client.post(CHAT, json=body, headers=TURN)
    assert first.headers["x-streamfence-source"] == "upstream"
    assert again.headers["x-streamfence-source"] == "replayed" and len(upstream.seen) == 1
    assert again.json() == first.json()
    assert first.json()["choices"][0]["message"]["content"] == "J0 J1 J2 "


async def test_a_replay_window_holds_for_its_seconds_and_no_longer(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    # One second: a window is not rounded down to none. The retry at once is replayed
    # (the window counts from the answer's end); one past the window goes upstream again,
    # and the finished generation lets go of its turn.
    body = chat_body(tokens=2, prefix="W")
    async with replaying(make_proxy, upstream, 1.0) as (proxy, client):
        first = await client.post(CHAT, json=body, headers=TURN)
        again = await client.post(CHAT, json=body, headers=TURN)
        await proxy.runtime.wait_idle()  # the window is running (the reader is done)
        await asyncio.sleep(1.2)  # time passing is what is tested: past the window
        assert len(proxy.runtime.generations or ()) == 0  # let go of, with no client
        assert proxy.runtime.registry.live_keys() == 0
        later = await client.post(CHAT, json=body, headers=TURN)
        await proxy.runtime.wait_idle()
    sources = [r.headers["x-streamfence-source"] for r in (first, again, later)]
    assert sources == ["upstream", "replayed", "upstream"] and len(upstream.seen) == 2
    assert first.text == again.text == later.text


async def test_an_answer_cut_upstream_is_not_kept_for_replays(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    # Nothing to replay: once its client has its error, the generation lets go of its turn
    # (no window holds it), and the retry is a new answer.
    upstream.queue.extend([Script(tokens=4, prefix="C", fail_after=2), Script(prefix="N")])
    body = chat_body()
    async with replaying(make_proxy, upstream) as (proxy, client):
        cut = ""
        async with client.stream("POST", CHAT, json=body, headers=TURN) as r:
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                async for text in r.aiter_text():
                    cut += text
        await proxy.runtime.wait_idle()
        assert len(proxy.runtime.generations or ()) == 0
        assert proxy.runtime.registry.live_keys() == 0
        again = await client.post(CHAT, json=body, headers=TURN)
    assert "C1 " in cut and "C2 " not in cut
    assert again.headers["x-streamfence-source"] == "upstream" and "N1 " in again.text


@pytest.mark.parametrize("cap", ["join_buffer_bytes", "join_buffer_total_bytes"])
async def test_over_a_buffer_cap_an_identical_request_starts_a_new_generation(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream, cap: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="streamfence")
    key = f"upstream.{cap}" if cap == "join_buffer_bytes" else f"server.{cap}"
    body = chat_body(gated=True, tokens=8, prefix="C")
    async with make_proxy(upstream.url, **HEALTHY, **{key: 300}) as proxy:
        async with proxy.client() as client, AsyncExitStack() as stack:
            a = await open_stream(stack, client, CHAT, body, TURN)
            a_events = events(a)
            await anext(a_events)
            upstream.seen[0].release(2)
            await anext(a_events)
            await anext(a_events)  # three chunks of ~180 bytes: over 300
            b = await open_stream(stack, client, CHAT, body, TURN)
            assert b.headers["x-streamfence-source"] == "upstream"
            a_rest = [e async for e in a_events]
            upstream.seen[1].release(10)
            b_text, _ = await _text(b)
        await proxy.runtime.wait_idle()
        assert _codes(a_rest) == ["stream_superseded"]
        assert b_text == "".join(f"C{i} " for i in range(8))
        assert (
            metric(
                proxy.runtime,
                "streamfence_follows_refused_total",
                upstream="default",
                reason="buffer_over_cap",
            )
            == 1
        )
        assert proxy.runtime.budget.used == 0
    # Logged (for each of the two generations), naming the turn as the access log does.
    messages = [r.getMessage() for r in caplog.records]
    (turn,) = {json.loads(m)["turn"] for m in messages if '"request"' in m}
    over = [m for m in messages if "its buffer is over its cap" in m]
    assert over and all(m.startswith(f"streamfence: turn {turn}: its buffer") for m in over)


async def test_the_budget_and_table_are_empty_after_many_followed_turns(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    async with make_proxy(upstream.url, **HEALTHY) as proxy, proxy.client() as client:
        for i in range(5):
            body = chat_body(prompt=f"turn {i}", tokens=3, gated=True)
            results: list[Any] = []
            async with AsyncExitStack() as stack:
                a = await open_stream(stack, client, CHAT, body)
                b = await open_stream(stack, client, CHAT, body)
                upstream.seen[-1].release(10)
                results = [await _text(a), await _text(b)]
            assert results[0][0] == results[1][0] == "0 1 2 "
        await proxy.runtime.wait_idle()
        assert len(upstream.seen) == 5
        assert len(proxy.runtime.generations or ()) == 0
        assert proxy.runtime.budget.used == 0
        assert proxy.runtime.registry.live_keys() == 0


async def test_a_retry_of_a_replaced_version_never_replaces_its_successor(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    """A client that retries a 409 whatever it says (the Vercel AI SDK, litellm's Router)
    re-sends the version of the turn that a newer one replaced: it is refused, and the
    newer one is never cut."""
    old = chat_body(prompt="first question", gated=True, tokens=3, prefix="O")
    edited = chat_body(prompt="edited question", gated=True, tokens=3, prefix="E")
    async with make_proxy(upstream.url, **HEALTHY) as proxy, proxy.client() as client:
        async with AsyncExitStack() as stack:
            first = await open_stream(stack, client, CHAT, old, TURN)
            first_events = events(first)
            await anext(first_events)
            newer = await open_stream(stack, client, CHAT, edited, TURN)
            newer_events = events(newer)
            await anext(newer_events)
            assert _codes([e async for e in first_events]) == ["stream_superseded"]
            stale = await client.post(CHAT, json=old, headers=TURN)
            upstream.seen[1].release(10)
            rest = [e async for e in newer_events]
        await proxy.runtime.wait_idle()
        # Nor once the newer one is over: that would be a second answer for the turn.
        later = await client.post(CHAT, json=old, headers=TURN)
    assert stale.status_code == 409 and stale.headers["x-should-retry"] == "false"
    assert stale.json()["error"]["code"] == "stream_superseded"
    assert "repeats an earlier version" in stale.json()["error"]["message"]
    assert "superseded by attempt 2 " in stale.json()["error"]["message"]
    assert "".join(e.text for e in rest) == "E1 E2 " and not _codes(rest)
    # The attempt that replaced it is remembered with the version: named after its end too.
    assert later.status_code == 409
    assert "superseded by attempt 2 " in later.json()["error"]["message"]
    assert len(upstream.seen) == 2
