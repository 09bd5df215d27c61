"""The one task per process that sends every `LogWriter`'s writes: `Publisher`.

A task per writer, each with its own command in flight, needed a pooled connection per
busy stream: with a few hundred streams the log's appends held every connection, claims
queued behind them and timed out (failing open), and writers timed out waiting for a
connection and gave up. One task sends the next write of every writer that has one, in
one round trip (one pipeline on one server; concurrent calls per node on a cluster), while
the next round's events queue and coalesce: a round costs one connection and one wake-up
however many streams there are, and Redis answers it as fast as it answers one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Protocol

from proxy.registry.genlog.timing import SWEEP
from proxy.registry.redisio import RETRY_AFTER, Call, Client
from proxy.registry.rounds import send_round
from proxy.tasks import cancelled


class Outbox(Protocol):
    """A writer (`writer.LogWriter`), as the publisher sees it: its writes, one at a time."""

    def take(self, now: float) -> Call | None: ...  # its next write, if one is due

    def answered(self, reply: Any, now: float) -> None: ...  # ... and Redis's reply to it


class Publisher:
    def __init__(self, client: Client) -> None:
        self.client = client
        self._writers: set[Outbox] = set()  # publishing: each gets heartbeats
        self._ready: dict[Outbox, None] = {}  # with a write queued (ordered: fair)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, writer: Outbox) -> None:
        self._writers.add(writer)
        if self._task is None or self._task.done():
            # Runs while any writer publishes; ends with the last (nothing left behind).
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="streamfence-log-publisher"
            )

    def wake(self, writer: Outbox) -> None:
        self._ready[writer] = None
        self._wake.set()

    def remove(self, writer: Outbox) -> None:
        self._writers.discard(writer)
        self._ready.pop(writer, None)

    async def close(self) -> None:
        if self._task is not None:
            await cancelled([self._task])
            self._task = None

    async def _run(self) -> None:
        swept = time.monotonic()
        while self._writers:
            if not self._ready:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), SWEEP)
            self._wake.clear()
            now = time.monotonic()
            writers = list(self._ready)
            self._ready.clear()
            if now - swept >= SWEEP:  # every writer: quiet ones are due a heartbeat
                swept, writers = now, list(self._writers)
            if await self._round(writers, now):
                await asyncio.sleep(RETRY_AFTER)

    async def _round(self, writers: list[Outbox], now: float) -> bool:
        """Send each writer's next write; True if any failed."""
        calls: list[Call] = []
        sent: list[Outbox] = []
        for writer in writers:
            call = writer.take(now)
            if call is not None:
                calls.append(call)
                sent.append(writer)
        if not calls:
            return False
        replies = await send_round(self.client, calls, "publish")
        now = time.monotonic()
        for writer, reply in zip(sent, replies, strict=True):
            writer.answered(reply, now)  # a writer with more to send wakes the next round
        return any(isinstance(reply, BaseException) for reply in replies)
