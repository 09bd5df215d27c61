"""What tests read of a running proxy that no event reports: its metrics, through the
registry's public sample API (never prometheus_client's private values), and a poll for state
held elsewhere (another process, Redis), bounded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from proxy.runtime import Runtime


def metric(runtime: Runtime, name: str, **labels: str) -> float:
    """A sample of the proxy's own metrics (`name` as exported, e.g.
    `streamfence_follows_total`), 0 when it has none yet."""
    value = runtime.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def until(
    check: Callable[[], Awaitable[bool]], within: float = 5.0, every: float = 0.02
) -> None:
    """Poll `check` until it holds: for state with no event to wait on (another process's,
    Redis's). Fails with what it waited for after `within` seconds."""
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"not reached within {within}s: {check}"
        await asyncio.sleep(every)
