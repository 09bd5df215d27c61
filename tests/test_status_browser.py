"""The status page in a real headless browser (Debian's chromium, driven over the DevTools
protocol): it loads with the access token in its URL, shows a turn while it is in flight,
then that turn's supersede after a retry, all pushed over its SSE feed. The screenshot it
takes is the one in the README (docs/status-page.png).

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

import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.conftest import ProxyFactory
from tests.sse_client import chat_body, events, open_stream
from tests.test_ops_status import reset_sse_starlette  # noqa: F401 - autouse fixture
from tests.upstream import ScriptedUpstream

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "status-page.png"
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
async def chromium(tmp: Path) -> AsyncIterator[Page]:
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
                width=1100,
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


async def test_status_page_shows_a_turn_in_flight_then_its_supersede(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    async with (
        make_proxy(upstream.url, **{"server.access_token": TOKEN}) as proxy,
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
        latency = await page.text(
            f"document.querySelector('#recent tr[data-turn=\"{turn}\"]').cells[4].textContent"
        )
        assert latency.endswith(" ms"), latency
        float(latency.split()[0])  # a number; its size is the benchmark's business (B5)
        assert page.console == []
        assert [s.path for s in upstream.seen] == [CHAT] * 3  # no /favicon.ico forwarded

        shot = await page.send("Page.captureScreenshot", format="png")
        png = base64.b64decode(shot["data"])
        assert png.startswith(b"\x89PNG")
        if os.environ.get("STREAMFENCE_UPDATE_DOCS"):  # refresh the README's picture on purpose
            SCREENSHOT.write_bytes(png)

        for seen in upstream.seen:
            seen.release(100)
        assert [e async for e in retry_events][-1].data == "[DONE]"
        assert [e async for e in other_events][-1].data == "[DONE]"


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
