"""Soak: a steady mix of streams, supersedes, disconnects and upstream failures for a fixed
time; afterwards the process's memory and open descriptors are back near where they started
(no leaked tasks, connections or registry entries).

CI runs STREAMFENCE_SOAK_SECONDS (default 8); by hand, e.g. STREAMFENCE_SOAK_SECONDS=600.
The proxy, the scripted upstream and the clients share this process, so the figures cover
all three; idle keep-alive connections (bounded pools) are counted apart from leaks.

Memory is judged only in a process that runs the soak alone, as scripts/test runs it
(`pytest tests/stress/test_soak.py --no-cov`): what other test modules imported or left behind
grows the RSS under the soak's traffic by 20 MiB and more (seen after a wide set of test
files), which would be measured as the soak's. Elsewhere the memory check refuses (the test
is skipped, saying why) after every other check has passed.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import pytest

from proxy.turn.generation import Generation
from proxy.turn.relay import Subscriber
from tests.conftest import ProxyFactory
from tests.scripted import ScriptedUpstream
from tests.stress import harness
from tests.stress.schedules import Attempt, Driver, driver_client

pytestmark = pytest.mark.soak

SECONDS = float(os.environ.get("STREAMFENCE_SOAK_SECONDS", "8"))
KEYS_PER_ROUND = 40
OWN_FILE = "tests/stress/test_soak.py"
SEED = int(os.environ.get("STREAMFENCE_SOAK_SEED", str(random.randrange(1 << 32))))


def attempt(rng: random.Random) -> Attempt:
    return Attempt(
        tokens=rng.randint(1, 6),
        upstream=rng.choices(["ok", "break", "error"], [8, 1, 1])[0],
        break_after=rng.randint(0, 4),
        client=rng.choices(["stay", "leave_early", "leave_after"], [6, 1, 2])[0],
        leave_after=rng.randint(1, 5),
        next_at=rng.choice(["before_headers", "mid_stream", "mid_stream", "after_end"]),
        mid=rng.randint(1, 5),
    )


def not_alone(session: pytest.Session) -> str | None:
    """Why this process cannot judge the soak's memory (None: it can)."""
    mine = {__name__, "tests.conftest", "tests.bounds"}
    others = sorted(
        name
        for name in sys.modules
        if name.startswith("tests.") and name not in mine and ".test_" in f".{name}"
    )
    items = sorted({item.nodeid.split("::")[0] for item in session.items} - {OWN_FILE})
    why = [f"imported {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}"] if others else []
    why += [f"collected {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"] if items else []
    coverage = sys.modules.get("coverage")
    if sys.gettrace() is not None or (coverage is not None and coverage.Coverage.current()):
        why.append("runs under coverage (or another tracer)")
    if not why:
        return None
    return (
        "the soak's memory growth is judged only in a process of its own, and this one "
        f"{'; '.join(why)}: run `pytest tests/stress/test_soak.py --no-cov -p no:cacheprovider` "
        "alone (scripts/test does)"
    )


def idle_upstream_connections(p_runtime: Any) -> int:
    transport = p_runtime.client.transport
    if hasattr(transport, "idle"):
        return int(transport.idle())
    return sum(1 for c in transport._pool.connections if c.is_idle())


async def test_steady_mix_leaves_memory_and_descriptors_where_they_started(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, request: pytest.FixtureRequest
) -> None:
    rng = random.Random(SEED)
    # Asked first: what this process has imported by now is what it had during the soak.
    memory_unjudged = not_alone(request.session)

    async with make_proxy(upstream.url) as p, AsyncExitStack() as stack:

        async def round_(driver: Driver) -> None:
            schedule = [
                [attempt(rng) for _ in range(rng.randint(1, 4))] for _ in range(KEYS_PER_ROUND)
            ]
            await driver.run(schedule)

        def usage() -> dict[str, int]:
            now = harness.process_usage()
            # Objects that would carry a whole request with them if anything kept them.
            now["relays"] = sum(isinstance(o, Subscriber | Generation) for o in gc.get_objects())
            now["tasks"] = len(asyncio.all_tasks())
            # Each idle keep-alive upstream connection holds two descriptors here (the
            # proxy's end and the upstream server's); the pool is bounded, not a leak.
            now["idle_upstream"] = idle_upstream_connections(p.runtime)
            now["fds_without_idle"] = now["fds"] - 2 * now["idle_upstream"]
            return now

        client = await stack.enter_async_context(driver_client(p.url, timeout=60))

        async def one_client_round() -> Driver:
            driver = Driver(client, upstream, p.runtime)
            await round_(driver)
            # Only the test's own logs, not the proxy's memory: kept per round, no further.
            upstream.seen.clear()
            driver.watch.records.clear()
            return driver

        # Warm up: imports, pools, caches and the allocator reach their working size.
        for _ in range(3):
            await one_client_round()
        start = usage()
        start_tasks = asyncio.all_tasks()
        started = time.perf_counter()
        rounds = attempts = superseded = 0
        violations: list[str] = []
        while time.perf_counter() - started < SECONDS:
            driver = await one_client_round()
            rounds += 1
            attempts += driver.totals.attempts
            superseded += driver.totals.superseded
            violations += driver.totals.violations
        # A task that finishes a moment after its request (uvicorn ending a connection's
        # cycle, the scripted upstream's disconnect watcher) is not a leak; one that stays is.
        newer = asyncio.all_tasks() - start_tasks - {asyncio.current_task()}
        if newer:
            await asyncio.wait(newer, timeout=2)
        end = usage()
        left = [repr(t)[:200] for t in asyncio.all_tasks()]
        harness.assert_clean(p.runtime)

    print(
        f"\nsoak (seed {SEED}): {time.perf_counter() - started:.1f} s, {rounds} rounds, "
        f"{attempts} requests, {superseded} superseded, {len(violations)} violations; "
        f"RSS {start['rss_kib'] / 1024:.1f} -> {end['rss_kib'] / 1024:.1f} MiB, "
        f"relays alive {start['relays']} -> {end['relays']}, "
        f"tasks {start['tasks']} -> {end['tasks']}, "
        f"fds {start['fds']} -> {end['fds']} "
        f"(idle upstream keep-alive {start['idle_upstream']} -> {end['idle_upstream']})"
    )
    assert violations == [], violations[:20]
    assert rounds >= 1
    assert end["relays"] == 0, (start, end)  # nothing holds a finished request
    assert end["tasks"] <= start["tasks"], (start, end, left)
    assert end["fds_without_idle"] <= start["fds_without_idle"] + 4, (start, end)
    if memory_unjudged is not None:
        pytest.skip(memory_unjudged)
    # malloc_trim'd RSS: a few MiB of allocator noise; a request kept per request is not.
    assert end["rss_kib"] <= start["rss_kib"] + 4 * 1024, (start, end)
