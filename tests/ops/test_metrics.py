"""Prometheus metrics at /_streamfence/metrics, read back over real HTTP after real traffic:
one request of each outcome, the histograms, the in-flight gauge, the access token, and that
no label carries a credential, a turn id or a body."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AsyncExitStack

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy import __version__
from proxy.ops.metrics import Metrics
from proxy.ops.record import Record
from proxy.registry import MemoryRegistry
from tests.conftest import Proxy, ProxyFactory
from tests.scripted import ScriptedUpstream, free_port
from tests.sse_client import chat_body, events, events_of_a_cut_body, open_stream

CHAT = "/v1/chat/completions"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def scrape(client: httpx.AsyncClient, **kw: str) -> Samples:
    response = await client.get("/_streamfence/metrics", headers=kw or None)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def count_finished(proxy: Proxy) -> Callable[[int], asyncio.Task[None]]:
    """Wrap Runtime.finished so a test can wait until n requests have been recorded."""
    rt = proxy.runtime
    original = rt.finished
    records: list[Record] = []
    changed = asyncio.Event()

    def spy(record: Record, error: object) -> None:
        original(record, error)  # type: ignore[arg-type]
        records.append(record)
        changed.set()

    rt.finished = spy  # type: ignore[method-assign]

    async def until(n: int) -> None:
        while len(records) < n:
            changed.clear()
            await changed.wait()

    return lambda n: asyncio.ensure_future(asyncio.wait_for(until(n), 10))


async def test_each_outcome_is_counted_by_upstream_dialect_and_outcome(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    finished = count_finished(proxy)
    async with proxy.client() as client, AsyncExitStack() as stack:
        # completed: one stream, no turn key
        done = await client.post(CHAT, json=chat_body("a"), headers={"X-Turn-Id": "none"})
        assert done.status_code == 200
        # not a proxied request: the proxy's own namespace answers 404 itself
        assert (await client.get("/_streamfence/nope")).status_code == 404
        # rejected: an empty turn id
        assert (await client.post(CHAT, json={}, headers={"X-Turn-Id": ""})).status_code == 400
        # upstream_error: the stream breaks after one event
        async with client.stream("POST", CHAT, json=chat_body("b", fail_after=1)) as broken:
            assert (await events_of_a_cut_body(broken))[-1].is_error
        # superseded + completed: a retry of a gated turn
        a = await open_stream(stack, client, CHAT, chat_body("c", gated=True), {"X-Turn-Id": "k"})
        a_events = events(a)
        await anext(a_events)
        during = await scrape(client)
        assert value(during, "streamfence_streams_in_flight") == 1
        b = await client.post(CHAT, json=chat_body("c"), headers={"X-Turn-Id": "k"})
        assert b.status_code == 200
        assert [e async for e in a_events][-1].json["error"]["code"] == "stream_superseded"
        await finished(5)
        # client_gone: the caller leaves a gated stream
        gone = await open_stream(stack, client, CHAT, chat_body("d", gated=True))
        gone_events = events(gone)
        await anext(gone_events)
        await gone.aclose()
        await finished(6)
        m = await scrape(client)

    up, chat = "default", "openai-chat"
    requests = "streamfence_requests_total"
    assert value(m, requests, upstream=up, dialect=chat, outcome="completed") == 2
    assert value(m, requests, upstream=up, dialect=chat, outcome="superseded") == 1
    assert value(m, requests, upstream=up, dialect=chat, outcome="upstream_error") == 1
    assert value(m, requests, upstream=up, dialect=chat, outcome="client_gone") == 1
    rejected = sum(
        v
        for (name, labels), v in m.items()
        if name == requests and ("outcome", "rejected") in labels
    )
    assert rejected == 1
    assert value(m, "streamfence_supersedes_total", upstream=up) == 1
    assert value(m, "streamfence_upstream_errors_total", upstream=up, kind="protocol") == 1
    assert value(m, "streamfence_streams_in_flight") == 0
    assert value(m, "streamfence_fence_latency_seconds_count") == 1
    assert 0 < value(m, "streamfence_fence_latency_seconds_sum") < 0.05
    assert value(m, "streamfence_fence_latency_seconds_bucket", le="0.05") == 1
    # Every request that got a first byte from the upstream has its added TTFB observed.
    assert value(m, "streamfence_added_ttfb_seconds_count") >= 4
    assert value(m, "streamfence_events_relayed_total", upstream=up) >= 5


async def test_connection_failures_count_as_upstream_errors_of_kind_connect(
    make_proxy: ProxyFactory,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with make_proxy(dead) as proxy, proxy.client() as client:
        response = await client.post(CHAT, json=chat_body("x"))
        assert response.status_code == 502
        m = await scrape(client)
    assert value(m, "streamfence_upstream_errors_total", upstream="default", kind="connect") == 1
    outcome = {"upstream": "default", "dialect": "openai-chat", "outcome": "upstream_error"}
    assert value(m, "streamfence_requests_total", **outcome) == 1


async def test_labels_never_carry_credentials_turn_ids_or_bodies(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    secrets = {
        "authorization": "Bearer sk-proj-SECRETKEY0123456789",
        "x-api-key": "sk-ant-SECRET-anthropic-key",
        "x-request-id": "req-SECRET-id-42",
        "X-Turn-Id": "turn-SECRET-id-77",
    }
    body_marker = "BODY-SECRET-do-not-label"
    async with proxy.client() as client:
        first = await client.post(CHAT, json=chat_body(body_marker), headers=secrets)
        second = await client.post(
            "/v1/messages", json={"messages": [body_marker], "stream": True}, headers=secrets
        )
        text = (await client.get("/_streamfence/metrics")).text
    turn = first.headers["x-streamfence-turn"]
    for secret in [*secrets.values(), body_marker, turn, second.headers["x-streamfence-turn"]]:
        assert secret not in text
        assert secret.split()[-1] not in text
    assert "SECRET" not in text
    # `model`: the model a request names, bounded per upstream (tests/ops/test_ledger.py).
    allowed = {"upstream", "dialect", "outcome", "kind", "how", "le", "model"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "streamfence_build_info" or not sample.name.startswith("stream"):
                continue  # process_*, python_* and the version: labels fixed by the collector
            assert set(sample.labels) <= allowed, sample


async def test_metrics_need_the_access_token_when_one_is_set(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with (
        make_proxy(upstream.url, **{"server.access_token": "tok"}) as proxy,
        proxy.client() as client,
    ):
        assert (await client.get("/_streamfence/metrics")).status_code == 401
        bad = await client.get("/_streamfence/metrics", headers={"x-streamfence-token": "tok2"})
        assert bad.status_code == 401
        assert await scrape(client, **{"x-streamfence-token": "tok"})
        # What Prometheus' `authorization` block sends (credentials_file or credentials).
        assert await scrape(client, authorization="Bearer tok")
        assert await scrape(client, authorization="bearer  tok")
        for wrong in ("Bearer tok2", "Basic dG9rOg==", "tok", "Bearer"):
            denied = await client.get("/_streamfence/metrics", headers={"authorization": wrong})
            assert denied.status_code == 401, wrong
            assert denied.headers["www-authenticate"] == "Bearer"
        # healthz stays open: orchestrators probe it without secrets
        assert (await client.get("/_streamfence/healthz")).status_code == 200
    assert upstream.seen == []


def test_dropped_events_and_fence_latency_are_observed_from_the_record() -> None:
    metrics = Metrics()
    record = Record(method="POST", path=CHAT, upstream="u", dialect="anthropic")
    record.outcome, record.dropped, record.events, record.fence_latency = "superseded", 3, 2, 0.002
    metrics.observe(record)
    m = parse(metrics.render().decode())
    assert value(m, "streamfence_events_dropped_total", upstream="u") == 3
    assert value(m, "streamfence_events_relayed_total", upstream="u") == 2
    assert value(m, "streamfence_fence_latency_seconds_bucket", le="0.002") == 1
    assert value(m, "streamfence_fence_latency_seconds_bucket", le="0.001") == 0
    # Two apps in one process keep separate counts.
    fresh = parse(Metrics().render().decode())
    assert value(fresh, "streamfence_events_dropped_total", upstream="u") == 0


async def test_bearer_is_only_for_metrics_on_the_proxy_path_it_is_the_upstream_credential(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with (
        make_proxy(upstream.url, **{"server.access_token": "tok"}) as proxy,
        proxy.client() as client,
    ):
        # The proxy's token as a bearer does not open the proxy path...
        refused = await client.post(
            CHAT, json=chat_body("a"), headers={"authorization": "Bearer tok"}
        )
        assert refused.status_code == 401
        # ...and the caller's own bearer still reaches the upstream untouched.
        headers = {"x-streamfence-token": "tok", "authorization": "Bearer sk-upstream-key"}
        ok = await client.post(CHAT, json=chat_body("b"), headers=headers)
        assert ok.status_code == 200
    assert [seen.headers.get("authorization") for seen in upstream.seen] == [
        "Bearer sk-upstream-key"
    ]


async def test_process_platform_and_build_info_are_exported(proxy: Proxy) -> None:
    async with proxy.client() as client:
        m = await scrape(client)
    assert value(m, "streamfence_build_info", version=__version__) == 1
    assert value(m, "process_resident_memory_bytes") > 1_000_000
    assert value(m, "process_open_fds") > 0
    assert any(name == "python_info" for name, _ in m)
    assert any(name == "python_gc_collections_total" for name, _ in m)


class NotReady(MemoryRegistry):
    async def ready(self) -> bool:
        return False


async def test_health_and_readiness_probes(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        assert (await client.get("/_streamfence/healthz")).json() == {"status": "ok"}
        ready = await client.get("/_streamfence/readyz")
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
    closed = {"registry.on_unavailable": "fail_closed"}
    async with (
        make_proxy(upstream.url, _app={"registry": NotReady()}, **closed) as proxy,
        proxy.client() as client,
    ):
        # Alive but not ready: orchestrators keep it running and send it no traffic.
        assert (await client.get("/_streamfence/healthz")).status_code == 200
        assert (await client.get("/_streamfence/readyz")).status_code == 503
    async with (
        make_proxy(upstream.url, _app={"registry": NotReady()}) as proxy,
        proxy.client() as client,
    ):
        # fail_open: still serving (unfenced), so still ready, and saying so.
        ready = await client.get("/_streamfence/readyz")
        assert (ready.status_code, ready.json()["status"]) == (200, "degraded")
    assert upstream.seen == []
