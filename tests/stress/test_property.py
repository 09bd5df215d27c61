"""Property: for every schedule hypothesis can think of (several turn keys, 1-4 attempts
each, arriving before headers, mid-stream or after the end, clients that leave, upstreams
that break or fail), the single-writer invariant holds. See schedules.py for the checks.

One upstream and one proxy serve every example: they run in an event loop of their own
(a thread), and each example is one coroutine submitted to it. More examples:
STREAMFENCE_PROPERTY_EXAMPLES=500.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Iterator
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.config.load import load
from proxy.server.app import create_app
from tests.scripted import ScriptedUpstream, serve
from tests.stress.schedules import Attempt, Driver, Schedule, driver_client

pytestmark = pytest.mark.stress

EXAMPLES = int(os.environ.get("STREAMFENCE_PROPERTY_EXAMPLES", "60"))
T = TypeVar("T")


class Live:
    """An upstream, a proxy and a client, alive across examples in their own loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.stack = AsyncExitStack()
        self.driver: Driver | None = None

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        upstream = ScriptedUpstream()
        upstream.url, _ = await self.stack.enter_async_context(serve(upstream))
        app = create_app(load(env={}, overrides={"upstream.url": upstream.url}))
        proxy_url, _ = await self.stack.enter_async_context(serve(app))
        client = await self.stack.enter_async_context(driver_client(proxy_url, timeout=30))
        self.driver = Driver(client, upstream, app.state.runtime)

    def __enter__(self) -> Live:
        self.thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self.stack.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with Live() as running:
        yield running
        assert running.driver is not None
        t = running.driver.totals
        print(
            f"\nproperty: {t.schedules} schedules, {t.turns} turn keys, {t.attempts} attempts, "
            f"{t.superseded} superseded, {len(t.violations)} violations"
        )


attempts = st.builds(
    Attempt,
    tokens=st.integers(1, 4),
    upstream=st.sampled_from(["ok", "ok", "ok", "break", "error"]),
    break_after=st.integers(0, 5),
    client=st.sampled_from(["stay", "stay", "stay", "leave_early", "leave_after"]),
    leave_after=st.integers(1, 5),
    next_at=st.sampled_from(["before_headers", "mid_stream", "mid_stream", "after_end"]),
    mid=st.integers(1, 5),
)
schedules = st.lists(st.lists(attempts, min_size=1, max_size=4), min_size=1, max_size=4)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(schedule=schedules)
def test_single_writer_invariant_holds_for_every_schedule(live: Live, schedule: Schedule) -> None:
    assert live.driver is not None
    before = len(live.driver.totals.violations)
    live.call(live.driver.run(schedule))
    assert live.driver.totals.violations[before:] == []


def test_a_fixed_schedule_covers_every_arrival_kind(live: Live) -> None:
    """The shapes the property relies on, pinned, so a strategy change cannot lose them."""
    assert live.driver is not None
    schedule = [
        [Attempt(next_at="before_headers"), Attempt(next_at="mid_stream", mid=2), Attempt()],
        [Attempt(next_at="after_end"), Attempt(client="leave_early"), Attempt(tokens=4)],
        [Attempt(upstream="break", break_after=2, next_at="mid_stream", mid=3), Attempt()],
        [Attempt(client="leave_after", leave_after=1, mid=2), Attempt(upstream="error")],
    ]
    runs = live.call(live.driver.run(schedule))
    assert live.driver.totals.violations == []
    # The shapes really happened: a 409, a superseded frame, a clean win after a leaver.
    assert runs[0][0].status == 409
    assert runs[0][1].events[-1].json["error"]["code"] == "stream_superseded"
    assert runs[1][2].events[-1].data == "[DONE]"
    assert runs[3][1].status == 500
