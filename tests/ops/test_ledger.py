"""What the proxy spent and spared, in tokens (issue 30): usage read from each dialect's
answer through the proxy, in the log line, the metrics and the ledger's totals; a follower's
and a replay's spared tokens equal their generation's; a fenced Anthropic generation's input
tokens counted as cut; the model label bounded."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

import pytest
from websockets.asyncio.client import connect

from proxy.ops.ledger import OTHER, UNKNOWN, Ledger, ModelLabels
from proxy.ops.metrics import Metrics
from proxy.wire.usage import Usage
from tests.conftest import ProxyFactory
from tests.ops.test_status import _snapshots, _until
from tests.probes import metric
from tests.scripted import ScriptedUpstream
from tests.sse_client import chat_body, events, open_stream
from tests.websocket.test_fence import SCRIPT, create, events_until_end, ws_url
from tests.ws_upstream import ws_upstream

USAGE = {"input": 1200, "output": 40, "cached_input": 1024, "reasoning": 16}
PATHS = {
    "openai-chat": "/v1/chat/completions",
    "openai-responses": "/v1/responses",
    "anthropic": "/v1/messages",
    "gemini": "/v1beta/models/gemini-x:streamGenerateContent",
}
# What each dialect reports of USAGE (Anthropic and the others leave out some kinds).
REPORTED = {
    "openai-chat": USAGE,
    "openai-responses": USAGE,
    "anthropic": {"input": 1200, "output": 40, "cached_input": 1024},
    "gemini": USAGE,
}


def body(dialect: str, model: str = "model-x", **script: Any) -> dict[str, Any]:
    b = chat_body(**script)
    if dialect == "gemini":
        model = "gemini-x"  # named by the path (PATHS)
    else:
        b["model"] = model
    b["script"] = {**b.get("script", {}), "usage": USAGE, "model": model + "-2026"}
    return b


def tokens(proxy: Any, name: str, upstream: str = "default", model: str = "model-x-2026") -> dict:
    return {
        kind: metric(proxy.runtime, name, upstream=upstream, model=model, kind=kind)
        for kind in USAGE
        if metric(proxy.runtime, name, upstream=upstream, model=model, kind=kind)
    }


@pytest.mark.parametrize("dialect", list(PATHS))
async def test_the_usage_each_dialect_reports_is_spent_logged_and_counted(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, dialect: str, caplog: Any
) -> None:
    model = "gemini-x-2026" if dialect == "gemini" else "model-x-2026"
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        async with client.stream("POST", PATHS[dialect], json=body(dialect)) as r:
            assert r.status_code == 200
            [_ async for _ in r.aiter_bytes()]
        await proxy.runtime.wait_idle()
        assert tokens(proxy, "streamfence_tokens_total", model=model) == REPORTED[dialect]
        assert tokens(proxy, "streamfence_tokens_spared_total", model=model) == {}
        (row,) = proxy.runtime.ledger.summary()
        assert row["requests"] == 1 and row["tokens"] == REPORTED[dialect]
    lines = [json.loads(r.message) for r in caplog.records if '"msg":"request"' in r.message]
    (line,) = lines or [None]
    if line is not None:  # JSON log lines: the request model and the answer's
        assert line["model"] == ("gemini-x" if dialect == "gemini" else "model-x")
        assert line["response_model"] == model
        assert line["input_tokens"] == REPORTED[dialect]["input"]
        assert line["output_tokens"] == REPORTED[dialect]["output"]


async def test_a_non_streaming_answer_s_usage_is_counted(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        r = await client.post(PATHS["openai-chat"], json=body("openai-chat", stream=False))
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1200
        await proxy.runtime.wait_idle()
        assert tokens(proxy, "streamfence_tokens_total") == USAGE


async def test_a_follower_spares_what_its_generation_spent(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    turn = {"X-Turn-Id": "ledger-follow"}
    b = body("openai-chat", gated=True, tokens=3)
    async with make_proxy(upstream.url) as proxy, proxy.client() as client, AsyncExitStack() as s:
        first = await open_stream(s, client, PATHS["openai-chat"], b, turn)
        first_events = events(first)
        await anext(first_events)
        second = await open_stream(s, client, PATHS["openai-chat"], b, turn)
        assert second.headers["x-streamfence-source"] == "followed"
        upstream.seen[0].release(100)
        [_ async for _ in first_events]
        [_ async for _ in events(second)]
        await proxy.runtime.wait_idle()
        assert len(upstream.seen) == 1
        assert tokens(proxy, "streamfence_tokens_total") == USAGE
        assert tokens(proxy, "streamfence_tokens_spared_total") == USAGE
        (row,) = proxy.runtime.ledger.summary()
        assert (row["requests"], row["requests_spared"]) == (1, 1)


async def test_a_replay_spares_what_its_generation_spent(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    turn = {"X-Turn-Id": "ledger-replay"}
    async with (
        make_proxy(upstream.url, **{"upstream.replay_window": 30.0}) as proxy,
        proxy.client() as client,
    ):
        b = body("anthropic")
        for _ in range(2):
            async with client.stream("POST", PATHS["anthropic"], json=b, headers=turn) as r:
                [_ async for _ in r.aiter_bytes()]
            await proxy.runtime.wait_idle()
        assert r.headers["x-streamfence-source"] == "replayed"
        assert len(upstream.seen) == 1
        assert tokens(proxy, "streamfence_tokens_spared_total") == REPORTED["anthropic"]


async def test_an_answer_kept_for_replays_is_counted_when_a_new_version_replaces_it(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    # Kept for its window, then replaced (the turn's next request is another body): it ends
    # there, and what it cost is counted then, not at the end of a window nobody can use.
    turn = {"X-Turn-Id": "ledger-replaced"}
    path = PATHS["openai-chat"]
    async with (
        make_proxy(upstream.url, **{"upstream.replay_window": 30.0}) as proxy,
        proxy.client() as client,
    ):
        await client.post(path, json=body("openai-chat"), headers=turn)
        await proxy.runtime.wait_idle()
        new = await client.post(path, json=body("openai-chat", prefix="B"), headers=turn)
        await proxy.runtime.wait_idle()
        assert new.headers["x-streamfence-source"] == "upstream" and len(upstream.seen) == 2
        # The first answer's; the second is kept for its own window.
        assert tokens(proxy, "streamfence_tokens_total") == USAGE


async def test_a_fenced_anthropic_generation_s_input_tokens_are_counted_as_cut(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    # Anthropic reports the input tokens in message_start: the generation fenced after its
    # first tokens has them, and they were billed; OpenAI's would report nothing.
    turn = {"X-Turn-Id": "ledger-cut"}
    path = PATHS["anthropic"]
    async with make_proxy(upstream.url) as proxy, proxy.client() as client, AsyncExitStack() as s:
        old = await open_stream(
            s, client, path, body("anthropic", gated_after_tokens=1, tokens=5), turn
        )
        old_events = events(old)
        while "content_block_delta" not in (await anext(old_events)).event:
            pass
        new = await open_stream(s, client, path, body("anthropic", prefix="B"), turn)
        [_ async for _ in old_events]
        [_ async for _ in events(new)]
        await proxy.runtime.wait_idle()
    cut = tokens(proxy, "streamfence_tokens_cut_total")
    # What message_start said: the input, and the one output token it always reports.
    assert cut == {"input": 1200, "cached_input": 1024, "output": 1}
    assert metric(proxy.runtime, "streamfence_events_cut_total", upstream="default") >= 3
    spent = tokens(proxy, "streamfence_tokens_total")
    assert spent["input"] == 2400  # both were billed for the prompt


def test_the_model_label_is_bounded() -> None:
    labels = ModelLabels(100)
    names = [labels("up", f"model-{i}") for i in range(10_000)]
    assert len(set(names)) == 101 and names[-1] == OTHER
    assert labels("up", "model-7") == "model-7"  # a model seen keeps its label
    assert labels("other-up", "model-9999") == "model-9999"  # per upstream
    assert labels("up", None) == UNKNOWN


def test_the_ledger_s_metrics_stay_bounded_under_ten_thousand_models() -> None:
    metrics = Metrics()
    ledger = Ledger(metrics, 100)
    for i in range(10_000):
        ledger.answered("up", f"model-{i}", Usage(input=1, output=1), False, 0)
    samples = [
        s
        for family in metrics.registry.collect()
        if family.name == "streamfence_tokens"
        for s in family.samples
        if s.name.endswith("_total")
    ]
    assert len({s.labels["model"] for s in samples}) == 101
    other = [s.value for s in samples if s.labels["model"] == OTHER and s.labels["kind"] == "input"]
    assert other == [9_900.0]


def test_unknown_usage_counts_a_request_and_no_tokens() -> None:
    ledger = Ledger(Metrics(), 10)
    ledger.answered("up", "m", None, False, 0)
    ledger.served("up", "m", None)
    (row,) = ledger.summary()
    assert (row["requests"], row["tokens"], row["requests_spared"]) == (1, {}, 1)


async def test_a_websocket_response_s_usage_is_spent(make_proxy: ProxyFactory) -> None:
    # The Responses API over WebSocket: response.completed carries what it cost.
    async with (
        ws_upstream() as wsup,
        make_proxy(wsup.url, **SCRIPT) as proxy,
        connect(ws_url(proxy)) as ws,
    ):
        await ws.send(create(tokens=["Hel", "lo"]))
        assert (await events_until_end(ws))[-1]["type"] == "response.completed"
        await proxy.runtime.wait_idle()
        assert tokens(proxy, "streamfence_tokens_total", model="m") == {"input": 1, "output": 1}
        (row,) = proxy.runtime.ledger.summary()
        assert (row["model"], row["requests"]) == ("m", 1)


async def test_the_configured_bound_labels_further_models_other(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with (
        make_proxy(upstream.url, **{"server.max_model_labels": 2}) as proxy,
        proxy.client() as client,
    ):
        for name in ("alpha", "beta", "gamma", "alpha"):
            b = {**body("openai-chat", model=name), "stream": False}
            assert (await client.post(PATHS["openai-chat"], json=b)).status_code == 200
        await proxy.runtime.wait_idle()
        rows = {row["model"]: row["requests"] for row in proxy.runtime.ledger.summary()}
    assert rows == {"alpha-2026": 2, "beta-2026": 1, OTHER: 1}


async def test_the_status_feed_shows_a_turn_s_tokens_so_far_and_what_was_spent_and_spared(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    path, turn = PATHS["anthropic"], {"X-Turn-Id": "ledger-status"}
    b = body("anthropic", gated_after_tokens=1, tokens=3)
    async with (
        make_proxy(upstream.url) as proxy,
        proxy.client() as client,
        proxy.client() as watcher,
        AsyncExitStack() as s,
    ):
        feed_response = await s.enter_async_context(watcher.stream("GET", "/_streamfence/feed"))
        feed = _snapshots(feed_response)
        first = await open_stream(s, client, path, b, turn)
        first_events = events(first)
        while "content_block_delta" not in (await anext(first_events)).event:
            pass
        # In flight: the input tokens message_start reported.
        snap = await _until(feed, lambda snap: any(f["tokens"] for f in snap["in_flight"]))
        assert snap["in_flight"][0]["tokens"] == {"input": 1200, "cached_input": 1024, "output": 1}
        twin = await open_stream(s, client, path, b, turn)
        assert twin.headers["x-streamfence-source"] == "followed"
        upstream.seen[0].release(100)
        [_ async for _ in first_events]
        [_ async for _ in events(twin)]
        snap = await _until(feed, lambda snap: snap["totals"]["requests"] == 2)
    (row,) = snap["spend"]
    assert (row["upstream"], row["model"], row["requests"]) == ("default", "model-x-2026", 1)
    assert row["tokens"] == row["tokens_spared"] == REPORTED["anthropic"]
    assert (row["requests_spared"], row["fenced"], row["tokens_cut"]) == (1, 0, {})


async def test_a_stream_longer_than_its_buffer_still_reports_its_usage(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    # Over join_buffer_bytes the buffer drops what the client has written, the usage chunk
    # included by the time the stream ends: the meter keeps the last events at each drop.
    async with (
        make_proxy(upstream.url, **{"upstream.join_buffer_bytes": 512}) as proxy,
        proxy.client() as client,
    ):
        async with client.stream(
            "POST", PATHS["openai-chat"], json=body("openai-chat", tokens=200)
        ) as r:
            [_ async for _ in r.aiter_bytes()]
        await proxy.runtime.wait_idle()
        assert proxy.runtime.budget.overflows == 1
        assert tokens(proxy, "streamfence_tokens_total") == USAGE
