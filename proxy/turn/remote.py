"""Following a generation that runs in another process (issue 15), through its log in Redis.

With the Redis registry every followable generation publishes its events to the generation
log (`proxy.registry.genlog.log`). A request whose turn has no generation in this process is
claimed with `Registry.claim_or_follow`: one script that applies the rule of a local
follower (`proxy.turn.rule.decide`) to the turn's holder in Redis (identical body, same
streaming mode, healthy -> follow; other mode, healthy -> beside) or else claims, creating
the new generation's log in the same step, so that a twin on another process a moment later
finds it. Still one round trip, as the claim was. A `RemoteGeneration` is then a generation
like any other to its
subscribers (a buffer, cursors, fencing; later identical requests in this process follow
it locally), whose reader reads the log instead of an upstream:

- fenced when this process hears a newer claim of the turn (`Registry.watch`), or when
  the log says the writer was superseded, whichever comes first;
- its readers are counted by the writer, its generation's tee, and the generation keeps its
  upstream open while any process still reads it (`proxy.turn.tee.hold`);
- the writer's process dying, or Redis losing the log, ends it with `GenerationLost`
  within `DETECT_WITHIN` (3 s): a clear error event, never a clean end of a cut answer;
- its health is the writer's: judged (proxy.wire.health) from the log's `last` stamp, which
  moves on content only, as the claim script judged it, never from when this process read a
  batch (a catch-up of old events is not a sign of life).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from proxy.errors import GenerationLost, UpstreamError
from proxy.registry import Follow, Lease, Registry
from proxy.registry.genlog.meta import End
from proxy.turn.ask import Ask
from proxy.turn.buffer import Budget
from proxy.turn.generation import Generation
from proxy.upstream import client as upstream
from proxy.upstream.client import UpstreamClient
from proxy.wire.sse import resumes_after

if TYPE_CHECKING:
    from proxy.registry.genlog.log import GenerationLog, LogReader


def cursor_after(follow: Follow, last_event_id: bytes | None) -> int | None:
    """Where a `Last-Event-ID` resumes in the remote generation (None: from the start)."""
    number = resumes_after(last_event_id, follow.token)
    return number if number is not None and number <= follow.events else None


class RemoteGeneration(Generation):
    asked_upstream = False  # its own process asked, and counts what it cost

    def __init__(
        self,
        ask: Ask,
        current: Follow,
        registry: Registry,
        client: UpstreamClient,
        budget: Budget,
        on_end: Callable[[Generation], None] = lambda g: None,
    ) -> None:
        # No registry for the base class: this process holds no lease to release. (Its
        # reader task starts only once this constructor has returned.)
        super().__init__(ask, client, None, budget, on_end)
        self._current = current
        source = registry.generation_log()
        assert source is not None, "a generation of another process is read from its log"
        self._source: GenerationLog = source
        self._watcher = registry
        self._reader: LogReader | None = None
        # The writer's last sign of life as the claim saw it, on this process's clock.
        self.alive_at = time.monotonic() - current.quiet

    def last_alive(self) -> float:
        """As the writer's process would judge it: from the log's `last` stamp, as of the
        reader's latest check (every CHECK_EVERY), else as of the claim."""
        reader = self._reader
        if reader is not None and reader.meta is not None:
            return reader.checked_at - reader.meta.since_activity
        return self.alive_at

    async def _read(self) -> None:
        key, current = self.ask.key, self._current
        assert key is not None
        self.lease = lease = Lease(key, current.token, current.attempt)
        self._watcher.watch(lease)
        lease.on_superseded(self._superseded)
        reader, superseded = None, False
        try:
            self.forwarded_at = time.perf_counter()
            reader = await self._source.follow(key, current.token, reader_id=current.reader_id)
            self._reader = reader
            start = await reader.wait_start()
            self.headers_at = time.perf_counter()
            self.raw_headers = [
                (n.encode("latin-1"), v.encode("latin-1")) for n, v in start.headers
            ]
            ctype = next((v for n, v in start.headers if n.lower() == "content-type"), "")
            self.is_sse = upstream.is_event_stream_type(ctype)
            self.status = start.status
            self.headers_ready.set()
            async for batch in reader:
                await self._take(batch.events, stamp=False)  # stamped by the writer already
            if reader.outcome is End.COMPLETED:
                self.completed = True
            elif reader.outcome is End.SUPERSEDED:
                superseded = True
            else:
                self.error = UpstreamError(
                    "streamfence: the upstream request failed in the process that sent it"
                )
        except GenerationLost as exc:
            self.error = exc
        finally:
            self._reader = None
            if reader is not None:
                await asyncio.shield(reader.aclose())
            self.closed_at = time.perf_counter()
            self._read_over()
            self._unretain()
            if superseded:  # last: it cancels this task; then the subscribers write frames
                lease.supersede()

    async def end(self) -> None:
        await super().end()
        if self.lease is not None:
            self._watcher.unwatch(self.lease)
