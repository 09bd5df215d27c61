"""The generation log: a generation's events in Redis, so that a process other than the one
holding its upstream can follow it (from the start, or after an event index, then live).
`GenerationLog` makes its writers (`writer`) and readers (`reader`); what they share is the
`store` (keys, scripts, what a log says), their time bounds are in `timing`.

Why Streams, not pub/sub plus a list: a follower must read what was sent before it came
and then the live events with nothing lost or doubled between the two. A Stream gives both
from one key with one cursor (XREAD BLOCK from the last id seen), trimmed by MAXLEN ~ and
expired like any key; pub/sub would need a subscription per follower, a separate list for
the catch-up, and a handover between them that can drop or repeat a batch; and a cluster
keeps a Stream on its slot's node while plain pub/sub fans every message out to every node.
Measured on this 2-core machine (bench/genlog.py, loopback): see docs/performance.md.

Liveness (`timing`): the writer stamps the log at least every HEARTBEAT; a reader that finds
the stamp older than DEAD_AFTER raises `GenerationLost("writer_gone")`, within DETECT_WITHIN
of the writer's death, never a hang. Readers re-register (READER_TTL), so the writer counts
how many any process still has (`LogWriter.readers`).

Failures never reach the writer's caller: a write that Redis refuses (unreachable, OOM
under maxmemory) or a log Redis lost (restarted, evicted) marks the writer `broken`; it stops
publishing and its generation carries on locally. Readers get `GenerationLost`.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.errors import GenerationLost, RegistryUnavailable
from proxy.registry.genlog.meta import Current, End, Meta, Start
from proxy.registry.genlog.publisher import Publisher
from proxy.registry.genlog.reader import Batch, LogReader
from proxy.registry.genlog.store import MAXLEN, Store
from proxy.registry.genlog.timing import (
    CHECK_EVERY,
    DEAD_AFTER,
    DETECT_WITHIN,
    HEARTBEAT,
    LINGER,
    READER_TTL,
    TTL,
)
from proxy.registry.genlog.writer import OUTCOMES, LogWriter
from proxy.registry.redisio import Client

__all__ = [
    "CHECK_EVERY",
    "DEAD_AFTER",
    "DETECT_WITHIN",
    "HEARTBEAT",
    "OUTCOMES",
    "READER_TTL",
    "Batch",
    "Current",
    "End",
    "GenerationLog",
    "GenerationLost",
    "LogReader",
    "LogWriter",
    "Meta",
    "Start",
]


class GenerationLog:
    """The generation logs on one Redis: their writers and readers, and the one task that
    sends every writer's writes (`publisher`)."""

    def __init__(
        self,
        client: Client,
        *,
        reads: Client | None = None,
        maxlen: int = MAXLEN,
        ttl: float = TTL,
        linger: float = LINGER,
    ) -> None:
        self.store = Store(client, reads=reads, maxlen=maxlen, ttl=ttl, linger=linger)
        self._publisher: Publisher | None = None
        # Called with the reason when a writer stops publishing (the app counts them).
        self.abandoned_hook: Callable[[str], None] | None = None

    def publisher(self) -> Publisher:
        """The one task that sends every writer's writes (`publisher`), made on first use."""
        if self._publisher is None:
            self._publisher = Publisher(self.store.client)
        return self._publisher

    async def close(self) -> None:
        if self._publisher is not None:
            await self._publisher.close()

    @staticmethod
    def keys(key: str, token: int) -> list[str]:
        """The log of generation `token` of turn `key`: stream, meta, readers."""
        return Store.keys(key, token)

    def writer(
        self, key: str, token: int, *, body_hash: str, streaming: bool, opened: bool = False
    ) -> LogWriter:
        """Start publishing generation `token` of `key`. Never waits and never raises: the
        log is created by the writer's first write, in its own task (`opened`: by the
        claim already, `RedisRegistry.claim_or_follow`)."""
        return LogWriter(
            self.store,
            self.publisher(),
            key,
            token,
            body_hash,
            streaming,
            opened,
            abandoned=self._abandoned,
        )

    async def open(self, key: str, token: int, *, body_hash: str, streaming: bool) -> LogWriter:
        """`writer`, once the log exists; raises `RegistryUnavailable` if it could not be made."""
        writer = self.writer(key, token, body_hash=body_hash, streaming=streaming)
        await writer.flushed()
        if writer.broken:
            raise RegistryUnavailable("streamfence: could not create the generation log")
        return writer

    async def follow(
        self, key: str, token: int, after: int | None = None, reader_id: str | None = None
    ) -> LogReader:
        """A registered reader of the log: batches from the start, or after event index
        `after`. Raises `GenerationLost` if there is no such log or its writer is gone.
        `reader_id`: the id it was registered under already (`claim_or_follow`)."""
        reader = LogReader(self.store, key, token, after, reader_id)
        await reader.check()
        reader.keep_alive()
        return reader

    async def current(self, key: str) -> Current | None:
        """The turn's current holder and its log's meta: one round trip."""
        return await self.store.current(key)

    async def readers(self, key: str, token: int, *, close_if_none: bool = False) -> int:
        """Readers registered on any process (and not expired). `close_if_none`: if there
        are none, mark the log ended in the same step (its writer is about to stop)."""
        return await self.store.readers(self.keys(key, token), close_if_none=close_if_none)

    def _abandoned(self, reason: str) -> None:
        # Looked up at each call: the app sets the hook after the log is made.
        if self.abandoned_hook is not None:
            self.abandoned_hook(reason)
