"""What the generation log's reader and writer share (`genlog`): where a generation's log lives
in Redis, and the calls that run its Lua scripts (`scripts`), each one round trip (`Store`).
What a log says is parsed in `meta`.

Per generation (turn K, token T), three keys under K's hash tag (one slot, so every script
is one round trip, on one server or a cluster):
    streamfence:{K}:gen:T          a Redis Stream: 'o' opened, 's' started (status, headers),
                                   'b' batch (the complete events of one upstream read:
                                   first index, lengths, bytes), 'e' end (an `End`)
    streamfence:{K}:gen:T:meta     a hash: body hash, streaming mode, status, headers, `at`
                                   (the writer's last stamp), `last` (health: content only),
                                   `next` (events published), `ended`
    streamfence:{K}:gen:T:readers  a sorted set: reader id -> expiry (Redis's clock)

Every method raises `RegistryUnavailable` where Redis fails (`redisio.translate`), except the
best-effort ones, which say so.
"""

from __future__ import annotations

import contextlib
from typing import Any

from redis.asyncio.cluster import RedisCluster

from proxy.errors import RegistryUnavailable
from proxy.registry.genlog.meta import Current, Meta
from proxy.registry.genlog.scripts import CURRENT, FOLLOW, OPEN, READERS, WRITE
from proxy.registry.genlog.timing import LINGER, READER_TTL, TTL
from proxy.registry.redisio import PREFIX, Call, Client, Keys, translate

MAXLEN = 10_000  # batches kept per generation (approximate: whole macro nodes go)


class Store:
    """The generation logs on one Redis: its scripts, registered once, and the bounds every
    log there gets (`maxlen` batches; expiry `ttl` after the writer's last stamp, `linger`
    after its end)."""

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

    @staticmethod
    def prefix(key: str) -> str:
        """The turn's log keys up to the token (scripts build the rest)."""
        return f"{PREFIX}{{{key}}}:gen:"

    @classmethod
    def keys(cls, key: str, token: int) -> list[str]:
        """The log of generation `token` of turn `key`: stream, meta, readers."""
        base = f"{cls.prefix(key)}{token}"
        return [base, base + ":meta", base + ":readers"]

    # The writer's calls, sent by the publisher in its rounds (`rounds.send_round`).

    def open_call(self, keys: list[str], body_hash: str, streaming: bool) -> Call:
        """A fresh log: its meta and an 'o' entry. Answers Redis's clock."""
        mode = "1" if streaming else "0"
        return (self._open, keys, [self.ttl_ms, self.maxlen, body_hash, mode])

    def write_call(
        self,
        keys: list[str],
        kind: str,
        meta: list[Any],
        entry: list[Any],
        *,
        alive: bool,
        ttl_ms: int,
    ) -> Call:
        """A write (scripts.WRITE): `meta` field pairs into the hash, an entry of `kind`
        ('' for none: a heartbeat) with `entry`'s field pairs; `alive` moves `last`;
        `ttl_ms` 0 neither extends the expiry nor counts the readers. Answers the readers
        registered, -2 (not counted) or -1 (the log is gone)."""
        args = [ttl_ms, self.maxlen, kind, "1" if alive else "0", len(meta) // 2, *meta, *entry]
        return (self._write, keys, args)

    # The reader's calls.

    async def follow(self, keys: list[str], reader_id: str) -> Meta | None:
        """Register (or refresh) `reader_id` as a reader for READER_TTL, unless the log has
        ended ('': only look); the log's meta, None if there is no such log."""
        args: list[str | int] = [reader_id, int(READER_TTL * 1000), self.ttl_ms]
        with translate("follow"):
            reply = await self._follow(keys=keys, args=args)
        return Meta.parse(int(reply[0]), reply[1:]) if len(reply) >= 2 else None

    async def read(self, stream: str, after: bytes, count: int, block_ms: int) -> Any:
        """Up to `count` entries after id `after` (XREAD), waiting up to `block_ms` for one."""
        client = self.reads
        with translate("follow"):
            if not isinstance(client, RedisCluster):
                return await client.xread({stream: after}, count=count, block=block_ms)
            await client.initialize()  # the slot map (once; a no-op after)
            # Named node: the cluster client would otherwise ask a node for XREAD's keys
            # (COMMAND GETKEYS) before every read, a second round trip.
            args = ("COUNT", count, "BLOCK", block_ms, "STREAMS", stream, after)
            node = client.get_node_from_key(stream)
            return await client.execute_command("XREAD", *args, target_nodes=node)

    async def unregister(self, keys: list[str], reader_id: str) -> None:
        """Best effort (a reader not unregistered expires after READER_TTL)."""
        with contextlib.suppress(RegistryUnavailable), translate("unregister"):
            await self.client.zrem(keys[2], reader_id)

    # Anyone's.

    async def current(self, key: str) -> Current | None:
        """The turn's current holder and its log's meta: one round trip."""
        with translate("current"):
            reply = await self._current(keys=[Keys.entry(key)], args=[self.prefix(key)])
        if len(reply) < 3:
            return None
        meta = Meta.parse(int(reply[0]), reply[3]) if reply[3] else None
        return Current(int(reply[1]), int(reply[2]), meta)

    async def readers(self, keys: list[str], *, close_if_none: bool = False) -> int:
        """Readers registered on any process (and not expired). `close_if_none`: if there
        are none, mark the log ended in the same step (its writer is about to stop)."""
        _, meta, readers = keys
        with translate("readers"):
            args = ["1" if close_if_none else "0"]
            return int(await self._readers(keys=[readers, meta], args=args))

    async def reopen(self, keys: list[str]) -> None:
        """Undo `readers(close_if_none=True)`: its writer carries on after all. Best effort."""
        with contextlib.suppress(RegistryUnavailable), translate("reopen"):
            await self.client.hdel(keys[1], "ended")
