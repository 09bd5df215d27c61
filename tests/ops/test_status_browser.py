"""The status page in a real headless browser (Debian's chromium, driven over the DevTools
protocol): it loads with the access token in its URL, shows a turn while it is in flight,
then that turn's supersede after a retry, and a turn that has gone stalled, all pushed over
its SSE feed; at 640 px it fits without wrapping a turn's hash. The screenshots it takes with
STREAMFENCE_UPDATE_DOCS=1 are the README's (docs/status-page.png, docs/status-page-640.png).

Waiting is by events: a MutationObserver inside the page resolves when the expected row
appears; the Python side only bounds the wait.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.conftest import ProxyFactory
from tests.ops.test_status import reset_sse_starlette  # noqa: F401 - autouse fixture
from tests.scripted import ScriptedUpstream, free_port
from tests.sse_client import Event, chat_body, events, events_of_a_cut_body, open_stream

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "status-page.png"
NARROW_SCREENSHOT = SCREENSHOT.with_name("status-page-640.png")
TOKEN = "browser-test-token"
CHAT = "/v1/chat/completions"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)"
)


class Page:
    """Just enough of the DevTools protocol: commands on one page session."""

    def __init__(self, ws: ClientConnection, session: str) -> None:
        self.ws = ws
        self.session = session
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self.console: list[str] = []

    async def pump(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            future = self._waiting.pop(msg.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(msg)
            elif msg.get("method") == "Runtime.exceptionThrown":
                self.console.append(json.dumps(msg["params"]["exceptionDetails"]))

    async def send(self, method: str, session: bool = True, **params: Any) -> Any:
        ident = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = future
        msg: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        await self.ws.send(json.dumps(msg))
        reply = await asyncio.wait_for(future, 15)
        if "error" in reply:
            raise AssertionError(f"{method}: {reply['error']}")
        return reply["result"]

    async def wait_for(self, predicate: str) -> None:
        """Until the JS expression `predicate` is true in the page (checked on each DOM change)."""
        expression = f"""new Promise((resolve) => {{
            const check = () => {{ if ({predicate}) {{ observer.disconnect(); resolve(true); }} }};
            const observer = new MutationObserver(check);
            observer.observe(document, {{subtree: true, childList: true, characterData: true}});
            check();
        }})"""
        try:
            await asyncio.wait_for(
                self.send("Runtime.evaluate", expression=expression, awaitPromise=True), 10
            )
        except TimeoutError:
            body = await self.text("document.body.innerText")
            raise AssertionError(f"page never showed {predicate!r}; it shows:\n{body}") from None

    async def text(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


@asynccontextmanager
async def chromium(tmp: Path, width: int = 1100) -> AsyncIterator[Page]:
    assert CHROMIUM is not None
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--no-proxy-server",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp}",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        "about:blank",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        url = ""
        while not url:
            line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
            if not line:
                raise AssertionError("chromium exited before its DevTools endpoint was up")
            if line.startswith("DevTools listening on "):
                url = line.split(" on ", 1)[1].strip()
        drain = asyncio.create_task(proc.stderr.read())  # keep its pipe from filling up
        async with connect(url, max_size=None) as ws:
            browser = Page(ws, "")
            pump = asyncio.create_task(browser.pump())
            target = await browser.send("Target.createTarget", session=False, url="about:blank")
            attached = await browser.send(
                "Target.attachToTarget", session=False, targetId=target["targetId"], flatten=True
            )
            browser.session = attached["sessionId"]
            await browser.send("Runtime.enable")
            await browser.send(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=720,
                deviceScaleFactor=1,
                mobile=False,
            )
            try:
                yield browser
            finally:
                await browser.send("Browser.close", session=False)
                pump.cancel()
        await asyncio.wait_for(proc.wait(), 15)
        drain.cancel()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _row(table: str, turn: str, text: str) -> str:
    """JS: a row of `table` for `turn` whose text contains `text`."""
    return (
        f"[...document.querySelectorAll('#{table} tr[data-turn=\"{turn}\"]')]"
        f".some((tr) => tr.innerText.includes({json.dumps(text)}))"
    )


# A second upstream, a local model server under /vllm, whose streams count as stalled after
# 1 s of silence; the default upstream's gated streams stay healthy for a minute.
VLLM = {
    "upstream.0.healthy_within": 60.0,
    "upstream.1.name": "vllm",
    "upstream.1.prefix": "/vllm",
    "upstream.1.healthy_within": 1.0,
}


def _with_vllm(url: str, index: int = 1) -> dict[str, object]:
    return {
        key.replace("upstream.1.", f"upstream.{index}."): value for key, value in VLLM.items()
    } | {f"upstream.{index}.url": url}


async def _stalled_turn(
    streams: AsyncExitStack, client: httpx.AsyncClient, page: Page, name: str
) -> tuple[str, AsyncIterator[Event]]:
    """A turn on the vllm upstream whose stream goes silent, until the page calls it stalled."""
    stuck = await open_stream(
        streams, client, "/vllm" + CHAT, chat_body(name, gated=True), {"X-Turn-Id": name}
    )
    stuck_events = events(stuck)  # held: an abandoned reader would close its stream
    await anext(stuck_events)
    turn = stuck.headers["x-streamfence-turn"]
    await page.wait_for(_row("inflight", turn, "stalled"))  # 1 s without an event
    return turn, stuck_events


async def test_status_page_shows_a_turn_in_flight_then_its_supersede(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    async with (
        make_proxy(
            upstream.url, **{"server.access_token": TOKEN}, **_with_vllm(upstream.url)
        ) as proxy,
        proxy.client(headers={"x-streamfence-token": TOKEN}) as client,
        chromium(tmp_path / "profile") as page,
        AsyncExitStack() as streams,
    ):
        await page.send("Page.navigate", url=f"{proxy.url}/_streamfence/?token={TOKEN}")
        await page.wait_for("document.getElementById('state')?.textContent === 'live'")
        assert await page.text("document.title") == "streamfence status"

        # Attempt 1 of a turn, held open by the upstream's gate.
        first = await open_stream(
            streams, client, CHAT, chat_body("plan", gated=True), {"X-Turn-Id": "t-1"}
        )
        first_events = events(first)
        await anext(first_events)
        turn = first.headers["x-streamfence-turn"]
        await page.wait_for(_row("inflight", turn, "#1"))

        # Another turn in flight, so the page has more than one row to show.
        other = await open_stream(
            streams, client, CHAT, chat_body("other", gated=True), {"X-Turn-Id": "t-2"}
        )
        other_events = events(other)  # held: an abandoned reader would close its stream
        await anext(other_events)

        # A revised request under the same turn id supersedes attempt 1, held in flight.
        retry = await open_stream(
            streams, client, CHAT, chat_body("plan, revised", gated=True), {"X-Turn-Id": "t-1"}
        )
        retry_events = events(retry)
        await anext(retry_events)
        assert retry.headers["x-streamfence-attempt"] == "2"
        rest = [e async for e in first_events]
        assert rest and rest[-1].json["error"]["code"] == "stream_superseded"

        await page.wait_for(_row("recent", turn, "#1 \u2192 #2"))
        await page.wait_for(_row("inflight", turn, "#2"))
        # Each turn in flight says whether a retry would follow it or replace it.
        stuck, stuck_events = await _stalled_turn(streams, client, page, "t-3")
        await page.wait_for(_row("inflight", turn, "healthy"))
        state = await page.text(
            f"document.querySelector('#inflight tr[data-turn=\"{stuck}\"]').cells[6].title"
        )
        assert "healthy within 1 s" in state and state.endswith("a retry now would replace it")
        latency = await page.text(
            f"document.querySelector('#recent tr[data-turn=\"{turn}\"]').cells[4].textContent"
        )
        assert latency.endswith(" ms"), latency
        float(latency.split()[0])  # a number; its size is the benchmark's business (B5)
        assert page.console == []
        # No /favicon.ico forwarded (the vllm prefix is stripped: the same upstream).
        assert [s.path for s in upstream.seen] == [CHAT] * 4

        shot = await page.send("Page.captureScreenshot", format="png")
        png = base64.b64decode(shot["data"])
        assert png.startswith(b"\x89PNG")
        if os.environ.get("STREAMFENCE_UPDATE_DOCS"):  # refresh the README's picture on purpose
            SCREENSHOT.write_bytes(png)

        for seen in upstream.seen:
            seen.release(100)
        assert [e async for e in retry_events][-1].data == "[DONE]"
        assert [e async for e in other_events][-1].data == "[DONE]"
        assert [e async for e in stuck_events][-1].data == "[DONE]"
        # Since start, per upstream and model: three requests to the default upstream, one of
        # them fenced (the chat streams report no usage: no tokens).
        spend = "document.querySelector('#spend tr[data-upstream=\"default\"]')"
        await page.wait_for(f"{spend}?.cells[2].textContent === '3'")
        cells = await page.text(f"[...{spend}.cells].map((c) => c.textContent).join('|')")
        assert cells == "default|m|3|-|0|-|1|-"


async def test_status_page_without_the_token_shows_nothing(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    async with (
        make_proxy(upstream.url, **{"server.access_token": TOKEN}) as proxy,
        chromium(tmp_path / "profile") as page,
    ):
        await page.send("Page.navigate", url=f"{proxy.url}/_streamfence/?token=wrong")
        await page.wait_for("document.body && document.body.innerText.includes('access token')")
        assert await page.text("document.getElementById('inflight')") is None


async def test_status_page_at_640px_shows_outcomes_errors_and_upstream_health(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # a second upstream nobody listens on
    options = {"upstream.1.url": dead, "upstream.1.name": "dead", "upstream.1.prefix": "/dead"}
    async with (
        make_proxy(upstream.url, **options, **_with_vllm(upstream.url, 2)) as proxy,
        proxy.client() as client,
        chromium(tmp_path / "profile", width=640) as page,
        AsyncExitStack() as streams,
    ):
        await page.send("Page.navigate", url=f"{proxy.url}/_streamfence/")
        await page.wait_for("document.getElementById('state')?.textContent === 'live'")
        await page.wait_for(_upstream("dead", "idle"))
        ok = await client.post(CHAT, json=chat_body("fine"))
        assert ok.status_code == 200
        async with client.stream("POST", CHAT, json=chat_body("broken", fail_after=1)) as r:
            assert (await events_of_a_cut_body(r))[-1].is_error
        refused = await client.post("/dead" + CHAT, json=chat_body("x"))
        assert refused.status_code == 502
        assert (await client.post(CHAT, json={}, headers={"X-Turn-Id": ""})).status_code == 400

        await page.wait_for(_count("outcomes", "upstream_error", 2))
        await page.wait_for(_count("outcomes", "completed", 1))
        await page.wait_for(_count("outcomes", "rejected", 1))
        await page.wait_for(_count("errors", "upstream_unreachable", 1))
        # Each upstream's health: the dead one failing, refused; the live one's last error
        # (the broken stream) and its recent time to first byte.
        await page.wait_for(_upstream("dead", "failing"))
        dead_row = await _cells(page, "dead")
        assert dead_row[4:6] == ["upstream_unreachable", "refused"]
        default_row = await _cells(page, "default")
        assert default_row[1] == "failing" and default_row[2:4] == ["2", "1"]
        assert default_row[7].endswith(" ms") and float(default_row[7].split()[0]) > 0
        # Turns in flight, one healthy and one stalled, and a supersede.
        first = await open_stream(
            streams, client, CHAT, chat_body("plan", gated=True), {"X-Turn-Id": "t-1"}
        )
        first_events = events(first)
        await anext(first_events)
        retry = await open_stream(
            streams, client, CHAT, chat_body("plan, revised", gated=True), {"X-Turn-Id": "t-1"}
        )
        retry_events = events(retry)
        await anext(retry_events)
        assert [e async for e in first_events][-1].json["error"]["code"] == "stream_superseded"
        turn = retry.headers["x-streamfence-turn"]
        await page.wait_for(_row("recent", turn, "#1 \u2192 #2"))
        stuck, stuck_events = await _stalled_turn(streams, client, page, "t-2")
        await page.wait_for(_row("inflight", turn, "healthy"))
        # The hashes stay on one line each (they wrapped onto a second one), the state shows.
        lines = await page.text(
            "[...document.querySelectorAll('#inflight td.mono, #recent td.mono')].map((td) => {"
            " const r = document.createRange(); r.selectNodeContents(td);"
            " return r.getClientRects().length; })"
        )
        assert lines == [1, 1, 1], f"a turn hash wraps at 640 px: {lines} line(s)"
        shown = await page.text(
            f"document.querySelector('#inflight tr[data-turn=\"{stuck}\"]').cells[6].offsetWidth"
        )
        assert shown > 0
        # Usable at 640 px: nothing wider than the window, the key columns still shown.
        width, room = await page.text(
            "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
        )
        assert room <= 640 and width <= room, f"the page is {width} px wide in {room} px"
        visible = await page.text(
            "[...document.querySelectorAll('#upstreams tr:first-child td')]"
            ".filter((td) => td.offsetWidth > 0).length"
        )
        assert visible == 7  # "when" and "last TTFB" step aside on a narrow screen
        overflow = await page.text(
            "[...document.querySelectorAll('table')].map((t) => t.parentElement.scrollWidth"
            " - t.parentElement.clientWidth)"
        )
        assert max(overflow) <= 0, f"tables scroll sideways at 640 px: {overflow}"
        assert page.console == []
        if os.environ.get("STREAMFENCE_UPDATE_DOCS"):  # the README's narrow picture, on purpose
            await page.send(
                "Emulation.setDeviceMetricsOverride",
                width=640,
                height=1000,
                deviceScaleFactor=1,
                mobile=False,
            )
            shot = await page.send("Page.captureScreenshot", format="png")
            NARROW_SCREENSHOT.write_bytes(base64.b64decode(shot["data"]))
        for seen in upstream.seen:
            seen.release(100)
        assert [e async for e in retry_events][-1].data == "[DONE]"
        assert [e async for e in stuck_events][-1].data == "[DONE]"


def _count(list_id: str, name: str, n: int) -> str:
    return f"document.querySelector('#{list_id} li[data-name=\"{name}\"] b')?.textContent === '{n}'"


def _upstream(name: str, state: str) -> str:
    return (
        f"document.querySelector('#upstreams tr[data-upstream=\"{name}\"]')"
        f"?.cells[1].textContent === '{state}'"
    )


async def _cells(page: Page, name: str) -> list[str]:
    cells: list[str] = await page.text(
        f"[...document.querySelector('#upstreams tr[data-upstream=\"{name}\"]').cells]"
        ".map((td) => td.textContent)"
    )
    return cells
