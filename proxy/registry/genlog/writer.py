"""Publishing a generation to its log (`genlog`): `LogWriter`.

`started` and `append` only queue: the relay never waits on Redis. The process's one
`Publisher` sends every writer's next write, all writers in one round trip, each write
coalescing the batches that queued up meanwhile, and stamps a quiet writer's liveness at
least every HEARTBEAT. A failed write is tried again until no write of that writer has
succeeded for DEAD_AFTER; then, or when Redis lost the log, the writer is `broken` (logged
once): it stops publishing, and its generation carries on locally. It also counts the log's
readers on every process (`readers_elsewhere`): whether the generation's upstream stays open
once no client of its own process reads it is the generation's decision (proxy.turn.tee).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from proxy.errors import RegistryUnavailable, StreamfenceError
from proxy.registry.genlog.meta import End
from proxy.registry.genlog.publisher import Publisher
from proxy.registry.genlog.store import Store
from proxy.registry.genlog.timing import DEAD_AFTER, HEARTBEAT
from proxy.registry.redisio import COMMAND_TIMEOUT, Call
from proxy.tasks import spawn

log = logging.getLogger("streamfence")

MAX_PENDING = 8 << 20  # bytes queued for Redis before the writer gives up (Redis too slow)
OUTCOMES = (End.COMPLETED, End.FAILED, End.SUPERSEDED)  # the ends a writer writes


class _Write(NamedTuple):
    kind: str  # 'o' open, '' heartbeat, 's' started, 'b' batch, 'e' end
    meta: list[Any]  # field pairs for the meta hash
    entry: list[Any]  # field pairs for the stream entry
    # It moves the log's `last` (proxy.wire.health): the response headers, or a batch with some
    # content in it. Keep-alives alone do not, nor the writer's own heartbeat (`at` only).
    alive: bool = False


HEARTBEAT_WRITE = _Write("", [], [])


class LogWriter:
    """Publishes one generation: a queue of writes that the process's `Publisher` sends,
    one at a time and in order. `started`/`append` only queue; appends coalesce into the
    batch still waiting to be sent."""

    def __init__(
        self,
        store: Store,
        publisher: Publisher,
        key: str,
        token: int,
        body_hash: str,
        streaming: bool,
        opened: bool = False,
        abandoned: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.store, self.key, self.token = store, key, token
        self.readers = 0  # readers registered on any process, as of the last write
        self.broken = False  # Redis failed or lost the log: nothing more is published
        self._abandoned = abandoned  # told why, once, when the writer stops publishing
        self._keys = store.keys(key, token)
        self._queue: deque[_Write] = deque()
        self._sending: _Write | None = None  # handed to the publisher, not yet answered
        self._next = 0  # index of the next event appended
        self._pending = 0  # bytes queued
        self._written_at = time.monotonic()  # Redis's last reply to a write
        self._taken_at = self._written_at  # the last write handed to the publisher
        self._ending = False
        self._refreshed = 0.0  # when the last write extended the expiry and counted readers
        self._idle = asyncio.Event()  # nothing queued, nothing being sent
        self._stopped = asyncio.Event()  # its end is written, or it gave up or was aborted
        self._publisher = publisher
        publisher.add(self)
        if opened:
            self._idle.set()
        else:
            self._put(_Write("o", [body_hash, streaming], []))

    def started(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        pairs = json.dumps([list(h) for h in headers])
        self._put(
            _Write("s", ["status", status, "headers", pairs], ["s", status, "h", pairs], True)
        )

    def append(self, events: Sequence[bytes], content: bool = True) -> None:
        """Queue the complete events of one upstream read; `content`: some of them is not a
        keep-alive (`dialects.carries_content`), which keeps the generation healthy."""
        if not events or self.broken or self._ending:
            return
        first = self._next
        self._next += len(events)
        self._pending += sum(map(len, events))
        if self._pending > MAX_PENDING:
            self._give_up("Redis is not keeping up", "behind")
            return
        last = self._queue[-1] if self._queue else None
        if last is not None and last.kind == "b":  # coalesce: still one write
            last.entry[1].extend(events)
            if content and not last.alive:
                self._queue[-1] = last._replace(alive=True)
        else:
            self._put(_Write("b", [], [first, list(events)], content))

    async def end(self, outcome: End) -> None:
        """Write the end marker (one of OUTCOMES) and stop; waits at most about one command
        timeout, whatever Redis does."""
        assert outcome in OUTCOMES, outcome
        if not self._ending:
            self._put(_Write("e", ["ended", outcome], ["o", outcome]))
            self._ending = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), COMMAND_TIMEOUT * 2)
        await self.abort()

    async def abort(self) -> None:
        """Stop publishing without an end: readers see the writer gone (DETECT_WITHIN)."""
        self._stop()

    async def flushed(self) -> None:
        """Until everything queued so far has been sent (or the writer gave up)."""
        await self._idle.wait()

    async def readers_elsewhere(self) -> int:
        """How many readers the log has on any process (the last count, recounted at least
        every HEARTBEAT); 0 also if the writer gave up, or Redis does not answer. When it
        finds none, the log is ended in the same step, so that nobody starts to follow it
        now: `reopen` it if the generation carries on after all."""
        if self.broken:
            return 0
        if self.readers:
            return self.readers
        try:  # a reader may have registered since the writer last counted
            return await self.store.readers(self._keys, close_if_none=True)
        except StreamfenceError:
            return 0

    def reopen(self) -> None:
        """Undo the end that `readers_elsewhere` wrote when it found none (in the background)."""
        spawn(self.store.reopen(self._keys))

    # The publisher's side.

    def take(self, now: float) -> Call | None:
        """The next write to send, as a script call; None if there is none (or one is
        being sent already: a writer's writes go one at a time, in order)."""
        if self._sending is not None or self._stopped.is_set():
            return None
        if not self._queue:
            if now - self._taken_at < HEARTBEAT:
                return None
            self._queue.append(HEARTBEAT_WRITE)
        write = self._sending = self._queue.popleft()
        self._taken_at = now
        return self._call(write, now)

    def answered(self, reply: Any, now: float) -> None:
        """The reply to the write `take` handed out: an int, or the RegistryUnavailable
        that failed it."""
        write, self._sending = self._sending, None
        if write is None or self._stopped.is_set():
            return  # aborted meanwhile
        if isinstance(reply, RegistryUnavailable):
            if now - self._written_at > DEAD_AFTER:
                self._give_up(reply.message, "unavailable")
            else:
                self._queue.appendleft(write)  # sent again (readers drop what they have)
                self._publisher.wake(self)
            return
        self._written_at = now
        if write.kind == "b":
            self._pending -= sum(map(len, write.entry[1]))
        count = 0 if write.kind == "o" else int(reply)  # 'o' answers Redis's clock
        if count == -1:
            self._give_up("Redis lost the log (restarted, or evicted it)", "lost")
            return
        if count >= 0:
            self.readers = count
        if write.kind == "e":
            self._stop()
        elif self._queue:
            self._publisher.wake(self)  # queued before this round took its write
        else:
            self._idle.set()

    def _call(self, write: _Write, now: float) -> Call:
        store = self.store
        if write.kind == "o":
            body_hash, streaming = write.meta
            return store.open_call(self._keys, body_hash, streaming)
        entry = write.entry
        ttl = store.linger_ms if write.kind == "e" else store.ttl_ms
        if write.kind == "b" and now - self._refreshed < HEARTBEAT:
            ttl = 0  # a busy stream: expiry and reader count once per HEARTBEAT, not per batch
        else:
            self._refreshed = now
        meta = list(write.meta)
        if write.kind == "b":
            first, events = entry
            meta += ["next", first + len(events)]
            entry = ["i", first, "l", ",".join(str(len(e)) for e in events), "d", b"".join(events)]
        return store.write_call(self._keys, write.kind, meta, entry, alive=write.alive, ttl_ms=ttl)

    def _put(self, write: _Write) -> None:
        if not self.broken and not self._ending:
            self._queue.append(write)
            self._idle.clear()
            self._publisher.wake(self)

    def _give_up(self, why: str, reason: str) -> None:
        if not self.broken:
            log.warning(
                "streamfence: turn %s: no longer publishing its generation to Redis (%s); "
                "it continues in this process",
                self.key[:16],
                why,
            )
            self._abandoned(reason)
        self.broken = True
        self._stop()

    def _stop(self) -> None:
        self._queue.clear()
        self._stopped.set()
        self._idle.set()
        self._publisher.remove(self)
