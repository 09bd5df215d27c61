"""What the reliability tests share: end-of-run checks on a proxy, and a way to wait for
its requests to finish on an event rather than by polling."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
from typing import Any

from proxy.errors import StreamfenceError
from proxy.ops.record import Record
from proxy.runtime import Runtime
from tests.probes import metric

WAIT_LIMIT = 60.0  # seconds: a hang fails the test instead of the whole run


def busy_upstream_connections(runtime: Runtime) -> int:
    """Upstream connections the proxy's pool still has in use (not idle, not closed)."""
    assert runtime.client is not None
    transport = runtime.client.transport
    if hasattr(transport, "in_use"):  # proxy.upstream.transport.Transport, the default
        return int(transport.in_use())
    pool = transport._pool  # type: ignore[attr-defined]
    return sum(1 for c in pool.connections if not (c.is_idle() or c.is_closed()))


def assert_clean(runtime: Runtime) -> None:
    """Nothing left behind: no registry entry, no relay in flight, no upstream in use."""
    assert runtime.registry.live_keys() == 0
    assert not runtime.active
    assert busy_upstream_connections(runtime) == 0
    assert metric(runtime, "streamfence_streams_in_flight") == 0


class FinishWatch:
    """Counts the proxy's finished requests (its one record per request) and wakes waiters.

    The relay is taken out of `Runtime.active` right after its record, with no await in
    between, so once `wait(n)` returns the n-th request has left no trace.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.records: list[Record] = []
        self._changed = asyncio.Event()
        inner = runtime.finished

        def finished(record: Record, error: StreamfenceError | None) -> None:
            inner(record, error)
            self.records.append(record)
            self._changed.set()

        runtime.finished = finished  # type: ignore[method-assign]

    async def wait(self, n: int) -> list[Record]:
        async with asyncio.timeout(WAIT_LIMIT):
            while len(self.records) < n:
                self._changed.clear()
                await self._changed.wait()
        return self.records


def _trim_malloc() -> None:
    # Freed memory that glibc keeps in its arenas still counts as resident; handing it back
    # first makes RSS show what is live, so growth means retention, not fragmentation.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def process_usage() -> dict[str, Any]:
    """This process's resident memory (KiB) and open descriptors, from /proc/self."""
    gc.collect()
    _trim_malloc()
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"rss_kib": rss, "fds": len(os.listdir("/proc/self/fd"))}


def watch(runtime: Runtime) -> FinishWatch:
    """The runtime's FinishWatch, attached on first use (attach before any request)."""
    existing: FinishWatch | None = getattr(runtime, "_finish_watch", None)
    if existing is None:
        existing = FinishWatch(runtime)
        runtime._finish_watch = existing  # type: ignore[attr-defined]
    return existing


async def settled(runtime: Runtime, requests: int) -> list[Record]:
    """Once `requests` requests have finished: check that nothing is left behind."""
    records = await watch(runtime).wait(requests)
    assert len(records) == requests, [r.outcome for r in records]
    assert_clean(runtime)
    return records
