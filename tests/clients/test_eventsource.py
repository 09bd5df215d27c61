"""A browser's native EventSource through the proxy (headless chromium over DevTools, as
in tests/ops/test_status_browser.py): a GET stream keyed by the `streamfence_turn` query
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
from tests.ops.test_status_browser import CHROMIUM, Page, chromium
from tests.scripted import Script, ScriptedUpstream

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
window.isClosed = (name) => window.sources[name].es.readyState === EventSource.CLOSED;
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
        got = await asyncio.wait_for(
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
    assert "exceptionDetails" not in got, got["exceptionDetails"]


async def log_of(page: Page, name: str) -> dict[str, Any]:
    raw = await page.text(f"JSON.stringify(logOf({json.dumps(name)}))")
    parsed: dict[str, Any] = json.loads(raw)
    return parsed


class Cuttable:
    """A TCP relay on loopback in front of the proxy whose connections a test can cut, as a
    network drop would: the browser then reconnects by itself."""

    def __init__(self, target: str) -> None:
        self.target_port = int(target.rsplit(":", 1)[1])
        self.links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.url = ""
        self.refusing = False  # the network is down: new connections are dropped at once

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        link = (writer, up_writer)
        self.links.add(link)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            finally:
                dst.close()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except OSError:
            pass  # cut
        finally:
            self.links.discard(link)

    def cut(self) -> None:
        for down, up in list(self.links):
            down.transport.abort()
            up.transport.abort()

    def down(self) -> None:
        """Cut, and drop every reconnect until `up()`."""
        self.refusing = True
        self.cut()

    def up(self) -> None:
        self.refusing = False

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Cuttable]:
        server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            server.close()
            self.cut()
            await server.wait_closed()


@asynccontextmanager
async def browser_on(proxy: Proxy | Cuttable, tmp: Path) -> AsyncIterator[Page]:
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
        await until(page, "isClosed('a') && isClosed('b')")
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
        await until(page, "isClosed('a') && isClosed('b')")
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


async def test_dropped_event_source_resumes_after_its_last_event_id(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """The tab's connection drops mid-stream while the generation runs on (another client
    of the same turn holds it): the browser reconnects with Last-Event-ID and gets exactly
    the events after it, then stops at the end. One upstream request."""
    upstream.queue.extend(
        [page_script(), Script(stream=True, raw=sse(*(f"e{i}" for i in range(6))), gated=True)]
    )
    url = f"{EVENTS}?streamfence_turn=tab-turn"
    async with (
        make_proxy(upstream.url, **{"upstream.healthy_within": 30}) as proxy,
        Cuttable(proxy.url).running() as relay,
        browser_on(relay, tmp_path) as page,
        proxy.client() as other,
        other.stream("GET", url) as held,  # another client, direct: it starts the stream
    ):
        assert held.headers["x-streamfence-source"] == "upstream"
        await page.text(f"openSource('a', {json.dumps(url)})")
        await until(page, "logOf('a').messages.length === 1")
        (stream,) = stream_requests(upstream)  # the tab follows the other client's stream
        stream.release(2)
        await until(page, "logOf('a').messages.length === 3")
        relay.cut()
        await until(page, "logOf('a').opens === 2")  # reconnected by itself
        stream.release(3)
        await until(page, "isClosed('a')")  # at the end: 204, stop reconnecting
        a = await log_of(page, "a")
        other_text = (await held.aread()).decode()
    assert [m["data"] for m in a["messages"]] == [f"e{i}" for i in range(6)]  # no duplicate
    assert len(stream_requests(upstream)) == 1
    assert all(f"data: e{i}" in other_text for i in range(6))


async def test_a_reconnect_naming_a_superseded_generation_gets_the_new_one_from_its_start(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """Resume never splices (CONTRACT section 3): tab A's connection drops mid-stream (a0,
    a1 read; another client holds the generation); while it is down, the generation stalls
    and a third client of the turn supersedes it. When the network is back the browser
    reconnects with A's Last-Event-ID, which names the superseded generation: it gets the new
    generation from its first event, never the rest of the old one, nor the new one from A's
    event number. Two upstream requests."""
    upstream.queue.extend(
        [
            page_script(),
            Script(stream=True, raw=sse("a0", "a1", "a2", "a3"), gated=True),
            Script(stream=True, raw=sse(*(f"b{i}" for i in range(6)), retry=None), gated=True),
        ]
    )
    url = f"{EVENTS}?streamfence_turn=tab-turn"
    overrides = {"upstream.healthy_within": HEALTHY_WITHIN}
    async with (
        make_proxy(upstream.url, **overrides) as proxy,
        Cuttable(proxy.url).running() as relay,
        browser_on(relay, tmp_path) as page,
        proxy.client() as other,
        other.stream("GET", url) as held,  # holds the first generation while A is away
    ):
        assert held.headers["x-streamfence-source"] == "upstream"
        await page.text(f"openSource('a', {json.dumps(url)})")
        await until(page, "logOf('a').messages.length === 1")
        old = stream_requests(upstream)[0]
        old.release(1)
        await until(page, "logOf('a').messages.length === 2")
        relay.down()
        await asyncio.sleep(HEALTHY_WITHIN + 0.2)  # the old generation stalls meanwhile
        async with other.stream("GET", url) as newer:  # supersedes it: attempt 2
            assert newer.headers["x-streamfence-source"] == "upstream"
            assert newer.headers["x-streamfence-attempt"] == "2"
            await asyncio.wait_for(old.closed.wait(), 5)
            new = stream_requests(upstream)[1]
            new.release(2)  # b0 (ungated), b1 and b2 are out before A is back
            await new.wait_sent(3)
            relay.up()
            # Reconnected: b0, b1, b2 at once (a check for exactly four raced the browser's
            # dispatch of b2, and failed under load).
            await until(page, "logOf('a').messages.length === 5")
            new.release(10)
            await until(page, "isClosed('a')")  # the end: 204 on its last reconnect
            other_text = (await newer.aread()).decode()
        a = await log_of(page, "a")
        held_text = (await held.aread()).decode()
    got = [m["data"] for m in a["messages"]]
    assert got == ["a0", "a1", *(f"b{i}" for i in range(6))]
    old_ids, new_ids = [m["id"] for m in a["messages"][:2]], [m["id"] for m in a["messages"][2:]]
    assert len({i.split("-")[0] for i in old_ids}) == len({i.split("-")[0] for i in new_ids}) == 1
    assert old_ids[0].split("-")[0] != new_ids[0].split("-")[0]  # two generations' tokens
    assert [i.split("-")[1] for i in new_ids] == [str(n) for n in range(1, 7)]  # from its start
    assert all(f"data: b{i}" in other_text for i in range(6))
    assert SUPERSEDED in held_text and "data: b0" not in held_text
    assert len(stream_requests(upstream)) == 2
