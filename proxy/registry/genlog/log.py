"""The generation log: a generation's events in Redis, so that a process other than the one
holding its upstream can follow it (from the start, or after an event index, then live).

Per generation (turn K, token T), three keys under K's hash tag (one slot, so every script
is one round trip, on one server or a cluster):
    streamfence:{K}:gen:T          a Redis Stream: 'o' opened, 's' started (status, headers),
                                   'b' batch (the complete events of one upstream read:
                                   first index, lengths, bytes), 'e' end (outcome)
    streamfence:{K}:gen:T:meta     a hash: body hash, streaming mode, status, headers, `at`
                                   (the writer's last stamp), `last` (health: content only),
                                   `ended`
    streamfence:{K}:gen:T:readers  a sorted set: reader id -> expiry (Redis's clock)

Why Streams, not pub/sub plus a list: a follower must read what was sent before it came
and then the live events with nothing lost or doubled between the two. A Stream gives both
from one key with one cursor (XREAD BLOCK from the last id seen), trimmed by MAXLEN ~ and
expired like any key; pub/sub would need a subscription per follower, a separate list for
the catch-up, and a handover between them that can drop or repeat a batch; and a cluster
keeps a Stream on its slot's node while plain pub/sub fans every message out to every node.
Measured on this 2-core machine (bench/genlog.py, loopback): see the README's Redis section.

Liveness: the writer stamps `at` with every write and at least every HEARTBEAT (1 s). A
reader checks every CHECK_EVERY (0.5 s), with Redis's own clock, and raises
`GenerationLost("writer_gone")` once the stamp is older than DEAD_AFTER (2 s): a dead
writer is detected within DETECT_WITHIN = 3 s, never a hang. The same check re-registers
the reader (READER_TTL 3 s), so the writer's stamps return how many readers any process
still has (`LogWriter.readers`), and a crashed reader stops counting after 3 s.

Failures never reach the writer's caller: a write that Redis refuses (unreachable, OOM
under maxmemory) or a log Redis lost (restarted, evicted) marks the writer `broken`; it stops
publishing and its generation carries on locally. Readers get `GenerationLost`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

from proxy.errors import GenerationLost, RegistryUnavailable
from proxy.registry.genlog.publisher import Publisher
from proxy.registry.genlog.reader import (
    CHECK_EVERY,
    DEAD_AFTER,
    DETECT_WITHIN,
    READER_TTL,
    Batch,
    LogReader,
    Meta,
    Start,
)
from proxy.registry.genlog.scripts import CURRENT, FOLLOW, OPEN, READERS, WRITE
from proxy.registry.genlog.writer import HEARTBEAT, OUTCOMES, LogWriter
from proxy.registry.redisio import PREFIX, Client, Keys, translate

__all__ = [
    "CHECK_EVERY",
    "DEAD_AFTER",
    "DETECT_WITHIN",
    "HEARTBEAT",
    "OUTCOMES",
    "READER_TTL",
    "Batch",
    "Current",
    "GenerationLog",
    "GenerationLost",
    "LogReader",
    "LogWriter",
    "Meta",
    "Start",
]

MAXLEN = 10_000  # batches kept per generation (approximate: whole macro nodes go)
TTL = 30.0  # a running log's keys live this long after its writer's last stamp
LINGER = 60.0  # an ended log's keys, for late resumes and replays


class Current(NamedTuple):
    token: int
    attempt: int
    meta: Meta | None  # None: the holder publishes no log (or it expired)


class GenerationLog:
    def __init__(
        self,
        client: Client,
        *,
        reads: Client | None = None,
        maxlen: int = MAXLEN,
        ttl: float = TTL,
        linger: float = LINGER,
    ) -> None:
        self.client = client
        # Blocking reads (XREAD BLOCK CHECK_EVERY) want a socket timeout longer than the
        # block itself; on `client` a loaded event loop would turn the block's own reply
        # into a timeout, and a healthy follower into "Redis unreachable".
        self.reads = reads or client
        self.maxlen = maxlen
        self.ttl_ms = int(ttl * 1000)
        self.linger_ms = int(linger * 1000)
        self._open = client.register_script(OPEN)
        self._write = client.register_script(WRITE)
        self._follow = client.register_script(FOLLOW)
        self._current = client.register_script(CURRENT)
        self._readers = client.register_script(READERS)
        self._publisher: Publisher | None = None
        # Called with the reason when a writer stops publishing (the app counts them).
        self.abandoned_hook: Callable[[str], None] | None = None

    def publisher(self) -> Publisher:
        """The one task that sends every writer's writes (`publisher`), made on first use."""
        if self._publisher is None:
            self._publisher = Publisher(self.client)
        return self._publisher

    async def close(self) -> None:
        if self._publisher is not None:
            await self._publisher.close()

    @staticmethod
    def prefix(key: str) -> str:
        """The turn's log keys up to the token (scripts build the rest)."""
        return f"{PREFIX}{{{key}}}:gen:"

    @classmethod
    def keys(cls, key: str, token: int) -> list[str]:
        base = f"{cls.prefix(key)}{token}"
        return [base, base + ":meta", base + ":readers"]

    def writer(
        self, key: str, token: int, *, body_hash: str, streaming: bool, opened: bool = False
    ) -> LogWriter:
        """Start publishing generation `token` of `key`. Never waits and never raises: the
        log is created by the writer's first write, in its own task (`opened`: by the
        claim already, `RedisRegistry.claim_or_follow`)."""
        return LogWriter(self, key, token, body_hash, streaming, opened)

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
        reader = LogReader(self, key, token, after, reader_id)
        await reader.check()
        reader.keep_alive()
        return reader

    async def current(self, key: str) -> Current | None:
        """The turn's current holder and its log's meta: one round trip."""
        with translate("current"):
            reply = await self._current(keys=[Keys.entry(key)], args=[self.prefix(key)])
        if len(reply) < 3:
            return None
        meta = Meta.parse(int(reply[0]), reply[3]) if reply[3] else None
        return Current(int(reply[1]), int(reply[2]), meta)

    async def reopen(self, key: str, token: int) -> None:
        """Undo `readers(close_if_none=True)`: its writer carries on after all."""
        with contextlib.suppress(RegistryUnavailable), translate("reopen"):
            await self.client.hdel(self.keys(key, token)[1], "ended")

    async def readers(self, key: str, token: int, *, close_if_none: bool = False) -> int:
        """Readers registered on any process (and not expired). `close_if_none`: if there
        are none, mark the log ended in the same step (its writer is about to stop)."""
        _, meta, readers = self.keys(key, token)
        with translate("readers"):
            args = ["1" if close_if_none else "0"]
            return int(await self._readers(keys=[readers, meta], args=args))
