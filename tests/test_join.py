"""on_retry = join | adaptive: a retry served from the stream already running, resumes with
Last-Event-ID, replay after completion, and the caps that fall back to supersede."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import openai

from tests.conftest import Proxy, ProxyFactory
from tests.sse_client import Event, chat_body, events, open_stream
from tests.upstream import ScriptedUpstream

CHAT = "/v1/chat/completions"
TURN = {"X-Turn-Id": "join-turn"}


def _ids(raw: str) -> list[int]:
    return [int(line[4:]) for line in raw.splitlines() if line.startswith("id: ")]


async def _text_and_ids(response: Any) -> tuple[str, list[int], list[Event]]:
    raw = ""
    got: list[Event] = []
    async for chunk in response.aiter_text():
        raw += chunk
    for block in raw.split("\n\n"):
        data = [ln[6:] for ln in block.splitlines() if ln.startswith("data: ")]
        if data:
            got.append(Event(None, "\n".join(data)))
    return "".join(e.text for e in got), _ids(raw), got


def _joined(proxy: Proxy, how: str) -> float:
    metric = proxy.runtime.metrics.served_from_stream.labels("default", how)
    return metric._value.get()  # type: ignore[attr-defined, no-any-return]


async def test_identical_retry_joins_the_running_stream(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    body = chat_body(gated=True, tokens=6, prefix="T")
    async with make_proxy(upstream.url, **{"upstream.on_retry": "join"}) as proxy:
        async with proxy.client() as client, AsyncExitStack() as stack:
            a = await open_stream(stack, client, CHAT, body, TURN)
            a_events = events(a)
            assert (await anext(a_events)).text == "T0 "
            seen = upstream.seen[0]
            seen.release(1)
            assert (await anext(a_events)).text == "T1 "
            b = await open_stream(stack, client, CHAT, body, TURN)
            assert b.headers["x-streamfence-attempt"] == "2"
            rest_a = [e async for e in a_events]
            seen.release(10)
            text, ids, got = await _text_and_ids(b)
        assert len(upstream.seen) == 1  # the provider generated once
        assert [e.json["error"]["code"] for e in rest_a] == ["stream_superseded"]
        assert text == "T0 T1 T2 T3 T4 T5 "  # everything, in order, no duplicates
        assert got[-1].data == "[DONE]"
        assert ids == list(range(1, len(ids) + 1))
        assert _joined(proxy, "joined") == 1
        assert len(proxy.runtime.join_tables["default"]) == 0
        assert proxy.runtime.join_tables["default"].budget.used == 0


async def test_adaptive_joins_a_healthy_stream_and_supersedes_a_stalled_one(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    for healthy_within, expect_requests in ((3600.0, 1), (0.0, 2)):
        upstream.seen.clear()
        options = {"upstream.on_retry": "adaptive", "upstream.healthy_within": healthy_within}
        body = chat_body(gated=True, tokens=3, prefix=f"H{healthy_within}")
        async with make_proxy(upstream.url, **options) as proxy, proxy.client() as client:
            async with client.stream("POST", CHAT, json=body, headers=TURN) as a:
                await anext(events(a))
                async with client.stream("POST", CHAT, json=body, headers=TURN) as b:
                    for seen in upstream.seen:
                        seen.release(10)
                    text, _, _ = await _text_and_ids(b)
        assert len(upstream.seen) == expect_requests, healthy_within
        assert text.split() == [f"H{healthy_within}{i}" for i in range(3)]


async def test_last_event_id_resumes_after_that_event(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    body = chat_body(gated=True, tokens=5, prefix="R")
    async with make_proxy(upstream.url, **{"upstream.on_retry": "join"}) as proxy:
        async with proxy.client() as client:
            async with client.stream("POST", CHAT, json=body, headers=TURN) as a:
                a_events = events(a)
                await anext(a_events)
                upstream.seen[0].release(2)
                await anext(a_events)
                await anext(a_events)  # the client has ids 1..3
                resume = {**TURN, "Last-Event-ID": "2"}
                async with client.stream("POST", CHAT, json=body, headers=resume) as b:
                    upstream.seen[0].release(10)
                    text, ids, _ = await _text_and_ids(b)
        assert text == "R2 R3 R4 "  # only the events after id 2
        assert ids[0] == 3
        assert len(upstream.seen) == 1
        assert "last-event-id" not in upstream.seen[0].headers
        assert _joined(proxy, "resumed") == 1


async def test_replay_after_completion_needs_an_explicit_turn_id(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    options = {"upstream.on_retry": "join", "upstream.replay_window": 60.0}
    body = chat_body(tokens=3, prefix="P")
    async with make_proxy(upstream.url, **options) as proxy, proxy.client() as client:
        first = await client.post(CHAT, json=body, headers=TURN)
        again = await client.post(CHAT, json=body, headers=TURN)
        assert len(upstream.seen) == 1  # replayed from memory
        assert again.text == first.text
        assert _joined(proxy, "replayed") == 1
        # Keyed by fingerprint only: an identical body may be a deliberate regeneration.
        await client.post(CHAT, json=chat_body(tokens=2, prefix="F"))
        await client.post(CHAT, json=chat_body(tokens=2, prefix="F"))
        assert len(upstream.seen) == 3


async def test_a_different_body_always_supersedes(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    async with make_proxy(upstream.url, **{"upstream.on_retry": "join"}) as proxy:
        async with proxy.client() as client:
            async with client.stream(
                "POST", CHAT, json=chat_body(gated=True, prefix="A"), headers=TURN
            ) as a:
                a_events = events(a)
                await anext(a_events)
                changed = chat_body(prompt="changed", prefix="B")
                async with client.stream("POST", CHAT, json=changed, headers=TURN) as b:
                    text, _, _ = await _text_and_ids(b)
                rest = [e async for e in a_events]
                await upstream.seen[0].closed.wait()  # the old generation is stopped
    assert len(upstream.seen) == 2
    assert text == "B0 B1 B2 "
    assert [e.json["error"]["code"] for e in rest] == ["stream_superseded"]


async def test_a_stream_over_its_buffer_cap_falls_back_to_supersede(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    options = {"upstream.on_retry": "join", "upstream.join_buffer_bytes": 300}
    body = chat_body(gated=True, tokens=8, prefix="C")
    async with make_proxy(upstream.url, **options) as proxy, proxy.client() as client:
        async with client.stream("POST", CHAT, json=body, headers=TURN) as a:
            a_events = events(a)
            await anext(a_events)
            upstream.seen[0].release(2)
            await anext(a_events)
            await anext(a_events)  # three chunks of ~180 bytes: over 300
            async with client.stream("POST", CHAT, json=body, headers=TURN) as b:
                upstream.seen[1].release(10)
                text, _, _ = await _text_and_ids(b)
            await upstream.seen[0].closed.wait()
        assert len(upstream.seen) == 2
        assert text == "".join(f"C{i} " for i in range(8))
        # Both generations passed the cap: the first before the retry, the second later.
        assert proxy.runtime.join_tables["default"].budget.overflows == 2
        assert proxy.runtime.join_tables["default"].budget.used == 0


async def test_the_owner_leaving_still_closes_the_upstream(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    async with make_proxy(upstream.url, **{"upstream.on_retry": "join"}) as proxy:
        async with proxy.client() as client:
            async with client.stream(
                "POST", CHAT, json=chat_body(gated=True, tokens=9), headers=TURN
            ) as a:
                await anext(events(a))
            await upstream.seen[0].closed.wait()
        assert upstream.seen[0].events_sent == 1
        assert len(proxy.runtime.join_tables["default"]) == 0


async def test_openai_sdk_through_a_join_with_event_ids(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream
) -> None:
    async with make_proxy(upstream.url, **{"upstream.on_retry": "join"}) as proxy:
        client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0)
        kwargs: dict[str, Any] = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "extra_body": {"script": {"gated": True, "tokens": 4, "prefix": "S"}},
            "extra_headers": TURN,
        }
        a = await client.chat.completions.create(**kwargs)
        a_iter = aiter(a)
        assert (await anext(a_iter)).choices[0].delta.content == "S0 "
        b = await client.chat.completions.create(**kwargs)
        upstream.seen[0].release(10)
        text = "".join([c.choices[0].delta.content or "" async for c in b if c.choices])
        await client.close()
    assert text == "S0 S1 S2 S3 "
    assert len(upstream.seen) == 1
