"""A browser's native EventSource through the proxy (headless chromium over DevTools, as
in tests/test_status_browser.py): a GET stream keyed by the `streamfence_turn` query
parameter (an EventSource cannot set headers), and the browser's own reconnects with
Last-Event-ID (CONTRACT section 3; issue 11 items 4 and 6).

The page is served through the proxy too, so that its EventSources are same-origin; the
upstream sends `retry: 150` so that a reconnect comes in 150 ms instead of the browser's
default ~3 s. What the page saw is read back from the page; every wait is a promise in the
page that a handler resolves, bounded on the Python side.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.clients.conftest import HEALTHY_WITHIN
from tests.conftest import Proxy, ProxyFactory
from tests.test_status_browser import CHROMIUM, Page, chromium
from tests.upstream import Script, ScriptedUpstream

pytestmark = [
    pytest.mark.clients,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed"),
]

EVENTS = "/events"
SUPERSEDED = "was superseded by attempt 2 of the same turn"

PAGE = """<!doctype html>
<html><head><link rel="icon" href="data:,"><title>eventsource</title></head><body><script>
window.sources = {};
let waiters = [];
function notify() {
  waiters = waiters.filter((w) => {
    if (!w.pred()) return true;
    w.resolve(true);
    return false;
  });
}
window.until = (pred) => new Promise((resolve) => { waiters.push({ pred, resolve }); notify(); });
window.openSource = (name, url) => {
  const log = { messages: [], errors: [], opens: 0 };
  const es = new EventSource(url);
  es.onopen = () => { log.opens++; notify(); };
  es.onmessage = (e) => { log.messages.push({ data: e.data, id: e.lastEventId }); notify(); };
  // Both the proxy's `event: error` (a MessageEvent with data) and a failed or ended
  // connection (a plain Event) arrive here.
  es.addEventListener("error", (e) => {
    log.errors.push({ data: e.data === undefined ? null : e.data, state: es.readyState });
    notify();
  });
  window.sources[name] = { es, log };
};
window.closed = (name) => window.sources[name].es.readyState === EventSource.CLOSED;
window.logOf = (name) => window.sources[name].log;
</script></body></html>
"""


def sse(*data: str, retry: int | None = 150) -> list[str]:
    head = f"retry: {retry}\n" if retry is not None else ""
    return [(head if i == 0 else "") + f"data: {d}\n\n" for i, d in enumerate(data)]


def page_script() -> Script:
    return Script(body=PAGE, content_type="text/html; charset=utf-8", stream=False)


async def until(page: Page, predicate: str) -> None:
    try:
        await asyncio.wait_for(
            page.send(
                "Runtime.evaluate", expression=f"until(() => {predicate})", awaitPromise=True
            ),
            10,
        )
    except TimeoutError:
        logs = await page.text(
            "JSON.stringify(window.sources, (k, v) => k === 'es' ? v.readyState : v)"
        )
        raise AssertionError(f"the page never saw {predicate!r}; it saw {logs}") from None


async def log_of(page: Page, name: str) -> dict[str, Any]:
    raw = await page.text(f"JSON.stringify(logOf({json.dumps(name)}))")
    parsed: dict[str, Any] = json.loads(raw)
    return parsed


@asynccontextmanager
async def browser_on(proxy: Proxy, tmp: Path) -> AsyncIterator[Page]:
    async with chromium(tmp / "profile") as page:
        await page.send("Page.navigate", url=f"{proxy.url}/page")
        loaded = """new Promise((resolve) => {
            if (document.readyState === "complete") resolve(location.pathname);
            else addEventListener("load", () => resolve(location.pathname));
        })"""
        for _ in range(20):  # until the evaluation lands in the new page, not about:blank
            got = await page.send("Runtime.evaluate", expression=loaded, awaitPromise=True)
            if got["result"].get("value") == "/page":
                break
        assert await page.text("typeof window.openSource") == "function"
        yield page


def stream_requests(upstream: ScriptedUpstream) -> list[Any]:
    return [s for s in upstream.seen if s.path == EVENTS]


async def test_twin_event_sources_share_one_stream_and_stop_at_its_end(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """Two tabs on one turn, 50 ms apart: one upstream request; each gets every event once,
    with ids; at the end each reconnects with the last id and is told to stop (204)."""
    upstream.queue.extend(
        [page_script(), Script(stream=True, raw=sse(*(f"e{i}" for i in range(6))), delay=0.1)]
    )
    async with (
        make_proxy(upstream.url, **{"upstream.healthy_within": HEALTHY_WITHIN}) as proxy,
        browser_on(proxy, tmp_path) as page,
    ):
        url = f"{EVENTS}?streamfence_turn=tab-turn"
        await page.text(f"openSource('a', {json.dumps(url)})")
        await asyncio.wait_for(upstream.wait_requests(2), 10)
        await asyncio.sleep(0.05)  # the scenario: the twin 50 ms later
        await page.text(f"openSource('b', {json.dumps(url)})")
        await until(page, "closed('a') && closed('b')")
        a, b = await log_of(page, "a"), await log_of(page, "b")
    expected = [f"e{i}" for i in range(6)]
    assert [m["data"] for m in a["messages"]] == expected
    assert [m["data"] for m in b["messages"]] == expected
    ids = [m["id"] for m in a["messages"]]
    assert all(ids) and len(set(ids)) == len(ids), ids  # the proxy numbered them
    assert [m["id"] for m in b["messages"]] == ids  # one generation, the same events
    assert a["errors"] and all(e["data"] is None for e in a["errors"])  # no error event
    (forwarded,) = stream_requests(upstream)  # the twin and both reconnects: none upstream
    assert "streamfence_turn" not in forwarded.query


async def test_fenced_event_source_reconnects_into_the_winner(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """Tab A's stream stalls past healthy_within; tab B opens the same turn and supersedes
    it. A gets the proxy's error event, then the browser reconnects by itself (with A's
    Last-Event-ID, of the old generation): it follows B's generation from its start instead
    of fencing it. Two upstream requests; B's stream is never cut."""
    upstream.queue.extend(
        [
            page_script(),
            Script(stream=True, raw=sse("a0", "a1", "a2"), gated=True),
            Script(stream=True, raw=sse(*(f"b{i}" for i in range(6))), delay=0.15),
        ]
    )
    async with (
        make_proxy(upstream.url, **{"upstream.healthy_within": HEALTHY_WITHIN}) as proxy,
        browser_on(proxy, tmp_path) as page,
    ):
        url = f"{EVENTS}?streamfence_turn=tab-turn"
        await page.text(f"openSource('a', {json.dumps(url)})")
        await until(page, "logOf('a').messages.length === 1")
        await asyncio.sleep(HEALTHY_WITHIN + 0.2)  # the stall itself
        await page.text(f"openSource('b', {json.dumps(url)})")
        await until(page, "closed('a') && closed('b')")
        a, b = await log_of(page, "a"), await log_of(page, "b")
        for seen in upstream.seen:
            seen.release(100)
    winner = [f"b{i}" for i in range(6)]
    assert [m["data"] for m in b["messages"]] == winner
    assert [m["data"] for m in a["messages"]] == ["a0", *winner]
    told = [e["data"] for e in a["errors"] if e["data"] is not None]
    assert len(told) == 1 and SUPERSEDED in told[0], a["errors"]
    assert all(e["data"] is None for e in b["errors"])
    assert len(stream_requests(upstream)) == 2
