"""The live status page at /_streamfence/ and its feed at /_streamfence/feed.

One self-contained HTML page (inline CSS and JS, no external assets) that shows the turns in
flight and the most recent supersedes, updated over SSE. The `StatusBoard` keeps what the
page needs beyond `Runtime.active`: recent supersedes and a few totals, and wakes the feeds
when something changes. It holds hashed turn keys only, never credentials or bodies.

Both routes honour the access token: the `x-streamfence-token` header, or `?token=` because
a browser's address bar and `EventSource` cannot send headers.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response

from proxy import __version__
from proxy.logs import Record

RECENT = 50  # supersedes kept for the page
# While streams are in flight their ages and event counts change continuously: a snapshot
# this often keeps the page live without sending one per relayed event.
REFRESH_SECONDS = 1.0
# A comment line this often when nothing changes, so idle-timeout middleboxes (30-60 s is
# common) keep the feed open, and a dead browser tab is noticed on the next write.
PING_SECONDS = 15


class _Relay(Protocol):
    record: Record


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


class StatusBoard:
    def __init__(self) -> None:
        self.recent: deque[Supersede] = deque(maxlen=RECENT)
        self.started_at = time.time()
        self.requests = 0
        self.supersedes = 0
        self.dropped = 0
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """Wake every feed; each waits on the event it saw, so none misses a change."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self) -> None:
        await self._changed.wait()

    def finished(self, record: Record) -> None:
        self.requests += 1
        self.dropped += record.dropped
        if record.outcome == "superseded":
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

    def snapshot(self, active: Iterable[_Relay]) -> dict[str, Any]:
        now = time.perf_counter()
        records = sorted((relay.record for relay in active), key=lambda r: r.started)
        flights = [
            {
                "turn": r.turn,
                "upstream": r.upstream,
                "dialect": r.dialect,
                "attempt": r.attempt,
                "age_s": round(now - r.started, 1),
                "events": r.events,
            }
            for r in records
            if r.finished_at is None
        ]
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started_at),
            "totals": {
                "requests": self.requests,
                "supersedes": self.supersedes,
                "dropped": self.dropped,
            },
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
    request: Request, token: bytes, board: StatusBoard, active: Iterable[_Relay]
) -> Response:
    if not token_ok(request, token):
        return _denied()

    # Set by sse-starlette when uvicorn is told to exit: the feed says goodbye and ends
    # cleanly, so an open tab never holds a shutdown for the grace period.
    stopping = anyio.Event()

    async def snapshots() -> AsyncIterator[dict[str, str]]:
        while not stopping.is_set():
            snap = board.snapshot(active)
            yield {"event": "status", "data": json.dumps(snap, separators=(",", ":"))}
            # Idle: wait for a change (pings keep the connection). Busy: tick for the ages.
            with anyio.move_on_after(REFRESH_SECONDS if snap["in_flight"] else PING_SECONDS * 4):
                await _first(board.wait, stopping.wait)
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


_SCRIPT = r"""
"use strict";
const token = new URLSearchParams(location.search).get("token");
const feedUrl = "/_streamfence/feed" + (token ? "?token=" + encodeURIComponent(token) : "");
const $ = (id) => document.getElementById(id);
function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
}
function fill(id, rows, render, empty) {
  const body = $(id);
  body.replaceChildren();
  if (!rows.length) {
    const tr = body.insertRow();
    const td = tr.insertCell();
    td.colSpan = 9;
    td.className = "empty";
    td.textContent = empty;
    return;
  }
  for (const r of rows) render(body.insertRow(), r);
}
function ms(v) { return v === null ? "-" : v < 1 ? v.toFixed(3) + " ms" : v.toFixed(1) + " ms"; }
function show(s) {
  $("inflight-count").textContent = s.in_flight.length;
  $("requests").textContent = s.totals.requests;
  $("supersedes").textContent = s.totals.supersedes;
  $("dropped").textContent = s.totals.dropped;
  $("version").textContent = "v" + s.version;
  fill("inflight", s.in_flight, (tr, f) => {
    tr.dataset.turn = f.turn;
    cell(tr, f.turn || "(no turn key)", "mono");
    cell(tr, f.upstream);
    cell(tr, f.dialect);
    cell(tr, f.attempt ? "#" + f.attempt : "-", "num");
    cell(tr, f.age_s.toFixed(1) + " s", "num");
    cell(tr, f.events, "num");
  }, "nothing in flight");
  fill("recent", s.recent, (tr, r) => {
    tr.dataset.turn = r.turn;
    cell(tr, new Date(r.at * 1000).toLocaleTimeString(), "num");
    cell(tr, r.turn, "mono");
    cell(tr, r.upstream);
    cell(tr, "#" + r.attempt + " \u2192 #" + (r.by_attempt ?? "?"), "num");
    cell(tr, ms(r.fence_latency_ms), "num");
    cell(tr, r.events, "num");
    cell(tr, r.dropped, "num");
  }, "no supersedes yet");
}
function connect() {
  const es = new EventSource(feedUrl);
  es.addEventListener("status", (e) => {
    $("state").textContent = "live";
    $("state").className = "live";
    show(JSON.parse(e.data));
  });
  es.addEventListener("shutdown", () => {
    $("state").textContent = "proxy stopping";
    $("state").className = "down";
  });
  es.onerror = () => { $("state").textContent = "reconnecting"; $("state").className = "down"; };
}
connect();
"""

_STYLE = """
:root { color-scheme: light dark; --fg: #1d232b; --muted: #6a7380; --line: #dde2e8;
  --bg: #f7f8fa; --card: #fff; --accent: #b4451f; --ok: #2d7d46; }
@media (prefers-color-scheme: dark) { :root { --fg: #e4e8ee; --muted: #9aa4b1;
  --line: #2e3540; --bg: #14181d; --card: #1b2027; --accent: #f08a5d; --ok: #6fcf8e; } }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, sans-serif; color: var(--fg); background: var(--bg); }
header { display: flex; align-items: baseline; gap: 1rem; padding: 1rem 1.5rem;
  border-bottom: 1px solid var(--line); background: var(--card); }
h1 { font-size: 1.15rem; margin: 0; }
h2 { font-size: 1rem; margin: 1.5rem 0 .5rem; }
main { padding: 0 1.5rem 2rem; max-width: 72rem; }
.muted, #version { color: var(--muted); }
#state { margin-left: auto; font-weight: 600; }
#state.live { color: var(--ok); } #state.down { color: var(--accent); }
.totals { display: flex; gap: 1rem; margin-top: 1rem; }
.totals div { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  padding: .5rem 1rem; min-width: 9rem; }
.totals b { display: block; font-size: 1.4rem; }
table { width: 100%; border-collapse: collapse; background: var(--card);
  border: 1px solid var(--line); border-radius: 6px; }
th, td { text-align: left; padding: .4rem .75rem; border-bottom: 1px solid var(--line); }
th { font-weight: 600; color: var(--muted); font-size: .8rem; text-transform: uppercase; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.mono { font-family: ui-monospace, monospace; }
td.empty { color: var(--muted); text-align: center; }
"""

PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>streamfence status</title>
<link rel="icon" href="data:,">
<style>{_STYLE}</style>
</head>
<body>
<header>
<h1>streamfence</h1><span id="version"></span>
<span class="muted">one writer per turn</span>
<span id="state" class="down">connecting</span>
</header>
<main>
<section class="totals">
<div><span class="muted">in flight</span><b id="inflight-count">0</b></div>
<div><span class="muted">requests finished</span><b id="requests">0</b></div>
<div><span class="muted">supersedes</span><b id="supersedes">0</b></div>
<div><span class="muted">events dropped</span><b id="dropped">0</b></div>
</section>
<h2>Turns in flight</h2>
<table>
<thead><tr><th>turn (hashed)</th><th>upstream</th><th>dialect</th><th class="num">attempt</th>
<th class="num">age</th><th class="num">events relayed</th></tr></thead>
<tbody id="inflight"></tbody>
</table>
<h2>Recent supersedes</h2>
<table>
<thead><tr><th class="num">when</th><th>turn (hashed)</th><th>upstream</th>
<th class="num">attempts</th><th class="num">fence latency</th>
<th class="num">events relayed</th><th class="num">dropped</th></tr></thead>
<tbody id="recent"></tbody>
</table>
</main>
<script>{_SCRIPT}</script>
</body>
</html>
"""

_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
PAGE_HEADERS = {
    # Only this page's own script and styles run, and it talks to this origin alone.
    "content-security-policy": (
        f"default-src 'none'; script-src 'sha256-{_SCRIPT_HASH}'; "
        "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    # The page URL may carry ?token=: never hand it to another site.
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
}
