"""Publishing a generation to its log (`genlog`): `LogWriter`.

`started` and `append` only queue: the relay never waits on Redis. One task sends, one
script per write (one round trip), coalescing the batches that queued up meanwhile; it
stamps the writer's liveness at least every HEARTBEAT. A failed write is tried again until
no write has succeeded for DEAD_AFTER; then, or when Redis lost the log, the writer is
`broken` (logged once): it stops publishing, and its generation carries on locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from proxy.errors import RegistryUnavailable
from proxy.registry.connection import COMMAND_TIMEOUT, patiently
from proxy.registry.logreader import DEAD_AFTER

if TYPE_CHECKING:
    from proxy.registry.genlog import GenerationLog

log = logging.getLogger("streamfence")

HEARTBEAT = 1.0  # the writer stamps its liveness at least this often
MAX_PENDING = 8 << 20  # bytes queued for Redis before the writer gives up (Redis too slow)
OUTCOMES = ("completed", "failed", "superseded")


class _Write(NamedTuple):
    kind: str  # 'o' open, '' heartbeat, 's' started, 'b' batch, 'e' end
    meta: list[Any]  # field pairs for the meta hash
    entry: list[Any]  # field pairs for the stream entry


class LogWriter:
    """Publishes one generation. `started`/`append` only queue (the relay never waits on
    Redis); one task sends, coalescing what queued up meanwhile into one batch."""

    def __init__(
        self,
        log: GenerationLog,
        key: str,
        token: int,
        body_hash: str,
        streaming: bool,
        opened: bool = False,
    ) -> None:
        self.log, self.key, self.token = log, key, token
        self.readers = 0  # readers registered on any process, as of the last write
        self.broken = False  # Redis failed or lost the log: nothing more is published
        self._keys = log.keys(key, token)
        self._queue: deque[_Write] = deque()
        self._next = 0  # index of the next event appended
        self._pending = 0  # bytes queued
        self._written_at = time.monotonic()  # Redis's last reply to a write
        self._ending = False
        self._refreshed = 0.0  # when the last write extended the expiry and counted readers
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued, nothing being sent
        if opened:
            self._idle.set()
        else:
            self._put(_Write("o", [body_hash, "1" if streaming else "0"], []))
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"streamfence-log-{key[:8]}"
        )

    def started(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        pairs = json.dumps([list(h) for h in headers])
        self._put(_Write("s", ["status", status, "headers", pairs], ["s", status, "h", pairs]))

    def append(self, events: Sequence[bytes]) -> None:
        """Queue the complete events of one upstream read."""
        if not events or self.broken or self._ending:
            return
        first = self._next
        self._next += len(events)
        self._pending += sum(map(len, events))
        if self._pending > MAX_PENDING:
            self._give_up("Redis is not keeping up")
            return
        last = self._queue[-1] if self._queue else None
        if last is not None and last.kind == "b":  # coalesce: still one round trip
            last.entry[1].extend(events)
        else:
            self._put(_Write("b", [], [first, list(events)]))

    async def end(self, outcome: str) -> None:
        """Write the end marker (completed / failed / superseded) and stop; waits at most
        about one command timeout, whatever Redis does."""
        assert outcome in OUTCOMES, outcome
        if not self._ending:
            self._put(_Write("e", ["ended", outcome], ["o", outcome]))
            self._ending = True
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._task), COMMAND_TIMEOUT * 2)
        await self.abort()

    async def abort(self) -> None:
        """Stop publishing without an end: readers see the writer gone (DETECT_WITHIN)."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._idle.set()

    async def flushed(self) -> None:
        """Until everything queued so far has been sent (or the writer gave up)."""
        await self._idle.wait()

    def _put(self, write: _Write) -> None:
        if not self.broken and not self._ending:
            self._queue.append(write)
            self._idle.clear()
            self._wake.set()

    def _give_up(self, why: str) -> None:
        if not self.broken:
            log.warning(
                "streamfence: turn %s: no longer publishing its generation to Redis (%s); "
                "it continues in this process",
                self.key[:16],
                why,
            )
        self.broken = True
        self._queue.clear()
        self._wake.set()
        self._idle.set()

    async def _run(self) -> None:
        while not self.broken:
            if not self._queue:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), HEARTBEAT)
            self._wake.clear()
            write = self._queue.popleft() if self._queue else _Write("", [], [])
            count = await self._send_patiently(write)
            if count is None:
                return
            if write.kind == "b":
                self._pending -= sum(map(len, write.entry[1]))
            if count == -1:
                self._give_up("Redis lost the log (restarted, or evicted it)")
                return
            if count >= 0:
                self.readers = count
            if not self._queue:
                self._idle.set()
            if write.kind == "e":
                return

    async def _send_patiently(self, write: _Write) -> int | None:
        """The write's reply; None once no write has succeeded for DEAD_AFTER (its readers
        allow that long a silence): the writer gives up. A write Redis did apply before its
        reply was lost is sent again: readers drop the batches they have (by index)."""
        try:
            reply = await patiently(
                lambda: self._send(write),
                "publish",
                answered_at=self._written_at,
                within=DEAD_AFTER,
            )
        except RegistryUnavailable as exc:
            self._give_up(exc.message)
            return None
        self._written_at = time.monotonic()
        return int(reply)

    async def _send(self, write: _Write) -> Any:
        if write.kind == "o":
            args = [self.log.ttl_ms, self.log.maxlen, *write.meta]
            await self.log._open(keys=self._keys, args=args)
            return 0
        entry = write.entry
        ttl = self.log.linger_ms if write.kind == "e" else self.log.ttl_ms
        now = time.monotonic()
        if write.kind == "b" and now - self._refreshed < HEARTBEAT:
            ttl = 0  # a busy stream: expiry and reader count once per HEARTBEAT, not per batch
        else:
            self._refreshed = now
        meta = list(write.meta)
        if write.kind == "b":
            first, events = entry
            meta += ["next", first + len(events)]
            entry = ["i", first, "l", ",".join(str(len(e)) for e in events), "d", b"".join(events)]
        args = [ttl, self.log.maxlen, write.kind, len(meta) // 2, *meta, *entry]
        return await self.log._write(keys=self._keys, args=args)
