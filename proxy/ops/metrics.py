"""Prometheus metrics, served at /_streamfence/metrics. Labels carry upstream names,
dialects, outcomes and error kinds only: never a credential, a turn id or a body.

    streamfence_requests_total{upstream,dialect,outcome}   finished requests; outcome is
        completed | superseded | client_gone | upstream_error | rejected | shutdown
        (shutdown: ended by the proxy's own shutdown after `shutdown_grace`)
    streamfence_streams_in_flight                          requests being served now
    streamfence_supersedes_total{upstream}                 attempts fenced by a newer one
    streamfence_events_dropped_total{upstream}             events the fence kept back
    streamfence_events_relayed_total{upstream}             SSE events written to clients
    streamfence_fence_latency_seconds                      newer claim -> old upstream closed
    streamfence_added_ttfb_seconds                         time to first byte the proxy adds
    streamfence_upstream_errors_total{upstream,kind}       connect | timeout | protocol | malformed
    streamfence_registry_unavailable_total                 forwarded unfenced (fail_open)
    streamfence_generation_logs_abandoned_total{reason}    generations that stopped publishing
        to Redis, so that followers elsewhere get `generation_lost` (reason: unavailable:
        Redis refused or did not answer for 2 s | lost: Redis lost the log | behind: 8 MiB
        queued for a Redis that does not keep up)
    streamfence_websocket_connections_total{upstream,outcome}  upgrades: accepted | refused
        (the upstream's status) | unreachable (426) | rejected (404/401/400) | client_gone
    streamfence_websocket_open                             relayed sockets open now
    streamfence_websocket_frames_total{upstream,direction} messages relayed:
        client_to_upstream | upstream_to_client (fenced ones are events_dropped)
    streamfence_generations_total{upstream}                requests that went upstream
    streamfence_follows_total{upstream,how}                requests served from a running or
        recorded generation instead (how: followed | resumed | replayed)
    streamfence_upstream_requests_saved_total{upstream}    the upstream requests those saved
    streamfence_events_saved_total{upstream}               events followers got from a buffer
    streamfence_follows_refused_total{upstream,reason}     identical requests that could not
        follow and started a generation (reason: buffer_over_cap)
    streamfence_build_info{version}                        always 1
    process_*, python_*                                    prometheus_client's process, platform
        and garbage-collector collectors, as on any Python exporter

Each app has its own CollectorRegistry, so several apps (tests, workers) never collide.
`/_streamfence/metrics` takes the access token as `x-streamfence-token` or as
`Authorization: Bearer` (what Prometheus' `authorization` scrape setting sends).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from proxy import __version__
from proxy.ops.record import FOLLOWER_SOURCES, Record

_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        Info("streamfence_build", "streamfence's version", registry=r).info(
            {"version": __version__}
        )
        self.requests = Counter(
            "streamfence_requests",
            "Finished requests",
            ["upstream", "dialect", "outcome"],
            registry=r,
        )
        self.in_flight = Gauge("streamfence_streams_in_flight", "Requests in flight", registry=r)
        self.supersedes = Counter(
            "streamfence_supersedes", "Attempts fenced by a newer attempt", ["upstream"], registry=r
        )
        self.dropped = Counter(
            "streamfence_events_dropped",
            "Upstream events the fence kept from a client",
            ["upstream"],
            registry=r,
        )
        self.events = Counter(
            "streamfence_events_relayed", "SSE events relayed to clients", ["upstream"], registry=r
        )
        self.fence_latency = Histogram(
            "streamfence_fence_latency_seconds",
            "From a superseding request's claim to the old upstream response closed",
            buckets=_FAST,
            registry=r,
        )
        self.added_ttfb = Histogram(
            "streamfence_added_ttfb_seconds",
            "Time to first byte the proxy adds on top of the upstream's",
            buckets=_FAST,
            registry=r,
        )
        self.upstream_errors = Counter(
            "streamfence_upstream_errors",
            "Upstream failures by kind",
            ["upstream", "kind"],
            registry=r,
        )
        self.generations = Counter(
            "streamfence_generations",
            "Requests that went upstream (a new generation, or beside a running one)",
            ["upstream"],
            registry=r,
        )
        self.follows = Counter(
            "streamfence_follows",
            "Requests served from a running or recorded generation of their turn",
            ["upstream", "how"],
            registry=r,
        )
        self.saved = Counter(
            "streamfence_upstream_requests_saved",
            "Upstream requests not made because a request followed a generation",
            ["upstream"],
            registry=r,
        )
        self.events_saved = Counter(
            "streamfence_events_saved",
            "Events followers received from a generation's buffer, not a request of their own",
            ["upstream"],
            registry=r,
        )
        self.follow_refused = Counter(
            "streamfence_follows_refused",
            "Identical requests that could not follow their turn's generation",
            ["upstream", "reason"],
            registry=r,
        )
        self.registry_unavailable = Counter(
            "streamfence_registry_unavailable",
            "Requests forwarded without fencing because the registry was unreachable",
            registry=r,
        )
        self.logs_abandoned = Counter(
            "streamfence_generation_logs_abandoned",
            "Generations that stopped publishing to Redis (followers elsewhere get an error)",
            ["reason"],
            registry=r,
        )

        self.ws_connections = Counter(
            "streamfence_websocket_connections",
            "WebSocket upgrades by outcome",
            ["upstream", "outcome"],
            registry=r,
        )
        self.ws_open = Gauge("streamfence_websocket_open", "Relayed WebSockets open", registry=r)
        self.ws_frames = Counter(
            "streamfence_websocket_frames",
            "WebSocket messages relayed",
            ["upstream", "direction"],
            registry=r,
        )

    def observe(self, record: Record, error_kind: str | None = None) -> None:
        up, child = record.upstream, self.child
        child(self.requests, up, record.dialect, record.outcome).inc()
        if record.events:
            child(self.events, up).inc(record.events)
        if record.dropped:
            child(self.dropped, up).inc(record.dropped)
        if record.fenced_generation:
            child(self.supersedes, up).inc()
        if record.fence_latency is not None:
            self.fence_latency.observe(record.fence_latency)
        if record.added_ttfb is not None:
            self.added_ttfb.observe(max(0.0, record.added_ttfb))
        if error_kind is not None:
            child(self.upstream_errors, up, error_kind).inc()
        if record.source in FOLLOWER_SOURCES and record.status != 204:
            child(self.follows, up, record.source).inc()
            child(self.saved, up).inc()
            child(self.events_saved, up).inc(record.events)

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, kept: prometheus_client checks the values, takes a lock
        and builds its key on every call, several times a request. The values come from
        closed sets (upstream names, dialects, outcomes, kinds), as its own children do."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)


def scrape_authorized(headers: Mapping[str, str], token: bytes) -> bool:
    """The metrics endpoint's check: the proxy's own token header, or a bearer token. Only
    here: on the proxy path `Authorization` is the caller's upstream credential."""
    if not token:
        return True
    given = headers.get("x-streamfence-token", "")
    if not given:
        scheme, _, credential = headers.get("authorization", "").partition(" ")
        given = credential.strip() if scheme.lower() == "bearer" else ""
    return hmac.compare_digest(given.encode(), token)
