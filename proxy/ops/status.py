"""The live status page at /_streamfence/ and its feed at /_streamfence/feed.

One self-contained HTML page (inline CSS and JS, no external assets) that shows the turns in
flight (each healthy or stalled: what a retry of it would do), the most recent supersedes,
the requests by outcome and by error, and each upstream's health (its last error and that
error's cause, its recent time to first byte), updated over SSE; usable from 640 px wide.
The `StatusBoard` keeps what the page needs beyond `Runtime.active` and wakes the feeds
when something changes. It holds hashed turn keys and error codes only, never credentials
or bodies.

Both routes honour the access token: the `x-streamfence-token` header, or `?token=` because
a browser's address bar and `EventSource` cannot send headers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import ssl
import statistics
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import anyio
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response

from proxy import __version__
from proxy.errors import chain
from proxy.ops.ledger import Ledger
from proxy.ops.record import FOLLOWER_SOURCES, Outcome, Record, Source
from proxy.ops.statuspage import PAGE, PAGE_HEADERS
from proxy.wire import health
from proxy.wire.usage import Usage

# Outcomes that say nothing of the upstream's health: the proxy's own refusals, clients that
# left, fences and shutdowns.
_NOT_THE_UPSTREAMS = frozenset(
    {Outcome.REJECTED, Outcome.CLIENT_GONE, Outcome.SUPERSEDED, Outcome.SHUTDOWN}
)
RECENT = 50  # supersedes kept for the page
TTFB_WINDOW = 50  # an upstream's "recent" time to first byte: its last this many requests
# While streams are in flight their ages and event counts change continuously: a snapshot
# this often keeps the page live without sending one per relayed event.
REFRESH_SECONDS = 1.0
# A comment line this often when nothing changes, so idle-timeout middleboxes (30-60 s is
# common) keep the feed open, and a dead browser tab is noticed on the next write.
PING_SECONDS = 15


class _Relay(Protocol):
    """A request in flight, as the page sees it (proxy.runtime.InFlight)."""

    record: Record

    def last_alive(self) -> float | None:
        """When what it reads last sent content (time.monotonic); None: nothing to judge."""
        ...

    def usage(self) -> Usage | None:
        """What its answer has reported it cost so far (Anthropic: the input, at the start)."""
        ...


NO_POLICY: Mapping[str, float] = MappingProxyType({})


def liveness(relay: _Relay, within: float | None, now: float) -> tuple[str, float | None]:
    """ "healthy" or "stalled" (what a retry of it would do: follow it or replace it) and the
    seconds since its last content event: the one rule (proxy/wire/health.py) on the moment
    the request's own generation (or WebSocket response) reports. ("", None) for what has no
    such moment, or no healthy_within. `now` is time.monotonic()."""
    alive = relay.last_alive()
    if alive is None or within is None:
        return "", None
    state = "healthy" if health.healthy(alive, now, within) else "stalled"
    return state, max(0.0, now - alive)


@dataclass(frozen=True, slots=True)
class Supersede:
    turn: str
    upstream: str
    attempt: int
    by_attempt: int | None
    fence_latency_ms: float | None
    events: int
    dropped: int
    at: float  # wall clock, for the page


def cause(error: BaseException) -> str:
    """What went wrong underneath an upstream error, in one word an operator can act on:
    refused, DNS, TLS, reset, timeout, or the error's kind (protocol, malformed)."""
    for seen in chain(error):
        if isinstance(seen, ConnectionRefusedError):
            return "refused"
        if isinstance(seen, socket.gaierror):
            return "DNS"
        if isinstance(seen, ssl.SSLError):
            return "TLS"
        if isinstance(seen, ConnectionResetError):
            return "reset"
        if isinstance(seen, TimeoutError):
            return "timeout"
    return str(getattr(error, "kind", "error"))


@dataclass(slots=True)
class UpstreamHealth:
    requests: int = 0
    errors: int = 0
    last_ok: bool | None = None  # how its latest request went; None: none yet
    last_error: str = ""  # an error code, or "http_5xx" for an upstream's own 5xx answer
    last_cause: str = ""
    last_error_at: float | None = None  # wall clock
    ttfb_ms: deque[float] = field(default_factory=lambda: deque(maxlen=TTFB_WINDOW))

    def view(self, name: str) -> dict[str, Any]:
        recent = list(self.ttfb_ms)
        return {
            "name": name,
            "state": "idle" if self.last_ok is None else "ok" if self.last_ok else "failing",
            "requests": self.requests,
            "errors": self.errors,
            "last_error": self.last_error,
            "last_cause": self.last_cause,
            "last_error_at": None if self.last_error_at is None else round(self.last_error_at, 3),
            "ttfb_p50_ms": round(statistics.median(recent), 1) if recent else None,
            "ttfb_last_ms": round(recent[-1], 1) if recent else None,
        }


class StatusBoard:
    def __init__(self, upstreams: Iterable[str] = (), ledger: Ledger | None = None) -> None:
        self.ledger = ledger  # what was spent and spared, per upstream and model
        self.recent: deque[Supersede] = deque(maxlen=RECENT)
        self.started_at = time.time()
        self.requests = 0
        self.supersedes = 0
        self.dropped = 0
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.upstreams: dict[str, UpstreamHealth] = {name: UpstreamHealth() for name in upstreams}
        # Made when a feed first waits: every request begins and ends with a change, and
        # with no status page open nobody waits for one.
        self._changed: asyncio.Event | None = None

    def changed(self) -> None:
        """Wake every feed; each waits on the event it saw, so none misses a change."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def next_change(self) -> Callable[[], Awaitable[object]]:
        """A wait for the first change after now. Taken before a snapshot, it returns at once
        for a change made while the snapshot was being sent (waiting on the board's event
        only afterwards missed it until the next change, seen in CI as a page one request
        behind)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed.wait

    def finished(self, record: Record, error: BaseException | None = None) -> None:
        self.requests += 1
        self.dropped += record.dropped
        self.outcomes[record.outcome] += 1
        if record.error:
            self.errors[record.error] += 1
        self._health(record, error)
        if record.fenced_generation:
            self.supersedes += 1
            latency = record.fence_latency
            self.recent.appendleft(
                Supersede(
                    turn=record.turn,
                    upstream=record.upstream,
                    attempt=record.attempt,
                    by_attempt=record.superseded_by,
                    fence_latency_ms=None if latency is None else round(latency * 1000, 3),
                    events=record.events,
                    dropped=record.dropped,
                    at=time.time(),
                )
            )
        self.changed()

    def _health(self, record: Record, error: BaseException | None) -> None:
        if record.upstream == "-":
            return  # rejected before routing
        health = self.upstreams.setdefault(record.upstream, UpstreamHealth())
        if record.outcome in _NOT_THE_UPSTREAMS:
            return  # nothing learnt about the upstream's health
        health.requests += 1
        if record.ttfb is not None:
            health.ttfb_ms.append(record.ttfb * 1000)
        failed = record.outcome == Outcome.UPSTREAM_ERROR or record.status >= 500
        health.last_ok = not failed
        if failed:
            health.errors += 1
            health.last_error = record.error or f"http_{record.status}"
            health.last_cause = (
                cause(error) if error is not None else f"upstream answered {record.status}"
            )
            health.last_error_at = time.time()

    def snapshot(
        self, active: Iterable[_Relay], healthy_within: Mapping[str, float] = NO_POLICY
    ) -> dict[str, Any]:
        """`healthy_within`: each upstream's, by name, for the turns' health."""
        now, monotonic = time.perf_counter(), time.monotonic()
        relays = sorted(active, key=lambda relay: relay.record.started)
        # One row per generation: its first client, and how many follow it.
        rows: dict[object, dict[str, Any]] = {}
        for relay in relays:
            r = relay.record
            if r.finished_at is not None:
                continue
            group: object = (r.turn, r.attempt) if r.turn and r.source != Source.BESIDE else id(r)
            row = rows.get(group)
            if row is None:
                within = healthy_within.get(r.upstream)
                state, silent = liveness(relay, within, monotonic)
                rows[group] = row = {
                    "turn": r.turn,
                    "upstream": r.upstream,
                    "dialect": r.dialect,
                    "attempt": r.attempt,
                    "age_s": round(now - r.started, 1),
                    "state": state,
                    "silent_s": None if silent is None else round(silent, 1),
                    "healthy_within_s": within if state else None,
                    "events": r.events,
                    "followers": 0,
                    "tokens": _tokens(relay.usage()),
                }
            if r.source in FOLLOWER_SOURCES:
                row["followers"] += 1
            row["events"] = max(row["events"], r.events)
        flights = list(rows.values())
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started_at),
            "totals": {
                "requests": self.requests,
                "supersedes": self.supersedes,
                "dropped": self.dropped,
            },
            "outcomes": dict(self.outcomes.most_common()),
            "errors": dict(self.errors.most_common()),
            "upstreams": [health.view(name) for name, health in self.upstreams.items()],
            "spend": [] if self.ledger is None else self.ledger.summary(),
            "in_flight": flights,
            "recent": [
                {
                    "turn": s.turn,
                    "upstream": s.upstream,
                    "attempt": s.attempt,
                    "by_attempt": s.by_attempt,
                    "fence_latency_ms": s.fence_latency_ms,
                    "events": s.events,
                    "dropped": s.dropped,
                    "at": round(s.at, 3),
                }
                for s in self.recent
            ],
        }


def _tokens(usage: Usage | None) -> dict[str, int]:
    return {} if usage is None else {kind.value: n for kind, n in usage.counts()}


def token_ok(request: Request, token: bytes) -> bool:
    if not token:
        return True
    given = request.headers.get("x-streamfence-token", "").encode()
    if not given:
        given = request.query_params.get("token", "").encode()
    return hmac.compare_digest(given, token)


def _denied() -> Response:
    return PlainTextResponse(
        "streamfence: the status page needs the access token "
        "(x-streamfence-token header or ?token=)\n",
        401,
        headers={"cache-control": "no-store"},
    )


async def page(request: Request, token: bytes) -> Response:
    if not token_ok(request, token):
        return _denied()
    return HTMLResponse(PAGE, headers=PAGE_HEADERS)


async def feed(
    request: Request,
    token: bytes,
    board: StatusBoard,
    active: Iterable[_Relay],
    healthy_within: Mapping[str, float] = NO_POLICY,
) -> Response:
    if not token_ok(request, token):
        return _denied()

    # Set by sse-starlette when uvicorn is told to exit: the feed says goodbye and ends
    # cleanly, so an open tab never holds a shutdown for the grace period.
    stopping = anyio.Event()

    async def snapshots() -> AsyncIterator[dict[str, str]]:
        while not stopping.is_set():
            change = board.next_change()
            snap = board.snapshot(active, healthy_within)
            yield {"event": "status", "data": json.dumps(snap, separators=(",", ":"))}
            # Idle: wait for a change (pings keep the connection). Busy: tick for the ages.
            with anyio.move_on_after(REFRESH_SECONDS if snap["in_flight"] else PING_SECONDS * 4):
                await _first(change, stopping.wait)
        yield {"event": "shutdown", "data": "{}"}

    return EventSourceResponse(
        snapshots(),
        ping=PING_SECONDS,
        headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        shutdown_event=stopping,
        shutdown_grace_period=1.0,
    )


async def _first(*waits: Callable[[], Awaitable[object]]) -> None:
    """Until the first of `waits` returns."""
    async with anyio.create_task_group() as tg:

        async def one(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            tg.cancel_scope.cancel()

        for wait in waits:
            tg.start_soon(one, wait)
