"""The status page itself (served by proxy/ops/status.py): one HTML document with its CSS and
script inline and no external assets, so that its Content-Security-Policy can allow exactly
this script (by hash) and nothing else. The script reads the SSE feed and fills the page."""

from __future__ import annotations

import base64
import hashlib

SCRIPT = r"""
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
function counts(id, data, empty) {
  const list = $(id);
  list.replaceChildren();
  const entries = Object.entries(data);
  if (!entries.length) {
    const li = document.createElement("li");
    li.className = "empty";
    li.textContent = empty;
    list.append(li);
  }
  for (const [name, n] of entries) {
    const li = document.createElement("li");
    li.dataset.name = name;
    const b = document.createElement("b");
    b.textContent = n;
    li.append(b, " " + name.replaceAll("_", " "));
    list.append(li);
  }
}
function ago(at) {
  if (at === null) return "-";
  const s = Math.max(0, Date.now() / 1000 - at);
  return s < 90 ? s.toFixed(0) + " s ago" : s < 5400 ? (s / 60).toFixed(0) + " min ago"
    : (s / 3600).toFixed(1) + " h ago";
}
function tok(t) {  /* input and output (cached input and reasoning are parts of them) */
  if (t.input === undefined && t.output === undefined) return "-";
  const n = (v) => v === undefined ? "?" : v.toLocaleString();
  return n(t.input) + " in / " + n(t.output) + " out";
}
function show(s) {
  $("inflight-count").textContent = s.in_flight.length;
  $("requests").textContent = s.totals.requests;
  $("supersedes").textContent = s.totals.supersedes;
  $("dropped").textContent = s.totals.dropped;
  $("version").textContent = "v" + s.version;
  counts("outcomes", s.outcomes, "no requests yet");
  counts("errors", s.errors, "no errors");
  fill("upstreams", s.upstreams, (tr, u) => {
    tr.dataset.upstream = u.name;
    cell(tr, u.name);
    cell(tr, u.state, "state-" + u.state);
    cell(tr, u.requests, "num");
    cell(tr, u.errors, "num");
    cell(tr, u.last_error || "-", "mono");
    cell(tr, u.last_cause || "-");
    cell(tr, ago(u.last_error_at), "num wide");
    cell(tr, ms(u.ttfb_p50_ms), "num");
    cell(tr, ms(u.ttfb_last_ms), "num wide");
  }, "no upstreams");
  fill("inflight", s.in_flight, (tr, f) => {
    tr.dataset.turn = f.turn;
    tr.dataset.state = f.state;
    cell(tr, f.turn || "(no turn key)", "mono hash");
    cell(tr, f.upstream);
    cell(tr, f.dialect, "wide");
    cell(tr, f.attempt ? "#" + f.attempt : "-", "num");
    cell(tr, f.followers, "num");
    cell(tr, f.age_s.toFixed(1) + " s", "num");
    cell(tr, f.state || "-", f.state ? "state-" + f.state : "");
    cell(tr, f.silent_s === null ? "-" : f.silent_s.toFixed(1) + " s", "num");
    cell(tr, f.events, "num wide");
    cell(tr, tok(f.tokens), "num wide");
    if (f.state) {
      tr.cells[6].title = f.state + ": " + f.silent_s.toFixed(1) + " s since its last "
        + "content event (healthy within " + f.healthy_within_s + " s); a retry now would "
        + (f.state === "healthy" ? "follow it" : "replace it");
    }
  }, "nothing in flight");
  fill("spend", s.spend, (tr, m) => {
    tr.dataset.upstream = m.upstream;
    tr.dataset.model = m.model;
    cell(tr, m.upstream);
    cell(tr, m.model, "mono");
    cell(tr, m.requests, "num");
    cell(tr, tok(m.tokens), "num");
    cell(tr, m.requests_spared, "num");
    cell(tr, tok(m.tokens_spared), "num");
    cell(tr, m.fenced, "num wide");
    cell(tr, tok(m.tokens_cut), "num wide");
  }, "nothing asked upstream yet");
  fill("recent", s.recent, (tr, r) => {
    tr.dataset.turn = r.turn;
    cell(tr, new Date(r.at * 1000).toLocaleTimeString(), "num");
    cell(tr, r.turn, "mono hash");
    cell(tr, r.upstream);
    cell(tr, "#" + r.attempt + " \u2192 #" + (r.by_attempt ?? "?"), "num");
    cell(tr, ms(r.fence_latency_ms), "num");
    cell(tr, r.events, "num wide");
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

STYLE = """
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
td.hash { white-space: nowrap; }
td.empty { color: var(--muted); text-align: center; }
.scroll { overflow-x: auto; }
.counts { display: flex; flex-wrap: wrap; gap: .5rem; list-style: none; padding: 0; margin: 0; }
.counts li { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  padding: .25rem .6rem; }
.counts li.empty { color: var(--muted); }
.state-ok { color: var(--ok); font-weight: 600; }
.state-failing { color: var(--accent); font-weight: 600; }
.state-idle { color: var(--muted); }
.state-healthy { color: var(--ok); }
.state-stalled { color: var(--accent); font-weight: 600; }
.cols { display: grid; grid-template-columns: 1fr 1fr; gap: 0 1.5rem; }
/* From 640 px: tiles wrap two by two, the less needed columns step aside. */
@media (max-width: 760px) {
  header { flex-wrap: wrap; gap: .25rem 1rem; padding: .75rem; }
  main { padding: 0 .75rem 1.5rem; }
  .totals { flex-wrap: wrap; gap: .5rem; }
  .totals div { flex: 1 1 40%; min-width: 0; }
  .cols { grid-template-columns: 1fr; }
  table { font-size: .85rem; }
  th, td { padding: .35rem .4rem; }
  td.mono { overflow-wrap: anywhere; }
  .wide { display: none; }
}
"""

PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>streamfence status</title>
<link rel="icon" href="data:,">
<style>{STYLE}</style>
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
<div class="cols">
<section><h2>Requests by outcome</h2><ul id="outcomes" class="counts"></ul></section>
<section><h2>Errors</h2><ul id="errors" class="counts"></ul></section>
</div>
<h2>Upstreams</h2>
<div class="scroll"><table>
<thead><tr><th>upstream</th><th>state</th><th class="num">requests</th>
<th class="num">errors</th><th>last error</th><th>cause</th><th class="num wide">when</th>
<th class="num">TTFB p50</th><th class="num wide">last TTFB</th></tr></thead>
<tbody id="upstreams"></tbody>
</table></div>
<h2>Turns in flight</h2>
<div class="scroll"><table>
<thead><tr><th>turn (hashed)</th><th>upstream</th><th class="wide">dialect</th>
<th class="num">attempt</th><th class="num">followers</th><th class="num">age</th>
<th title="healthy: a retry follows it; stalled: a retry replaces it">state</th>
<th class="num" title="since its last content event, or its start">silent</th>
<th class="num wide">events relayed</th>
<th class="num wide" title="as its provider reported them so far">tokens</th></tr>
</thead>
<tbody id="inflight"></tbody>
</table></div>
<h2>Spent and spared since start</h2>
<div class="scroll"><table>
<thead><tr><th>upstream</th><th>model</th>
<th class="num" title="requests sent upstream">requests</th>
<th class="num" title="as the provider reported them">tokens spent</th>
<th class="num" title="clients served without a request of their own">requests spared</th>
<th class="num">tokens spared</th>
<th class="num wide" title="generations a newer one fenced">fenced</th>
<th class="num wide" title="what the fenced ones had reported">tokens cut</th></tr></thead>
<tbody id="spend"></tbody>
</table></div>
<h2>Recent supersedes</h2>
<div class="scroll"><table>
<thead><tr><th class="num">when</th><th>turn (hashed)</th><th>upstream</th>
<th class="num">attempts</th><th class="num">fence latency</th>
<th class="num wide">events relayed</th><th class="num">dropped</th></tr></thead>
<tbody id="recent"></tbody>
</table></div>
</main>
<script>{SCRIPT}</script>
</body>
</html>
"""

SCRIPT_HASH = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
PAGE_HEADERS = {
    # Only this page's own script and styles run, and it talks to this origin alone.
    "content-security-policy": (
        f"default-src 'none'; script-src 'sha256-{SCRIPT_HASH}'; "
        "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    # The page URL may carry ?token=: never hand it to another site.
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
}
