"""The Redis registry: one turn registry shared by every process that points at one Redis.

Claiming runs one Lua script: take a fencing token, make it the key's holder (with a TTL,
so a crashed process leaves nothing behind for longer than `lease_ttl`) and publish the
claim with the token of the holder it replaced. Each process holds one subscription; a
claim message supersedes the local lease it replaced (`book`), so the per-event check stays
a local attribute read. That process then publishes an acknowledgement, and the claim
returns only once the replaced attempt's process has confirmed (or after ACK_WAIT, if it is
gone; `handshake`). Only a retry whose predecessor lives in another process waits for this.

Tokens come from a counter (one per server; one per hash slot in a cluster: see
`connection`) that never goes below Redis's clock in microseconds: a Redis restarted
without its data still hands out tokens above every token issued before.

Redis errors become `RegistryUnavailable` (in `connection.translate`). `fail_open`: a claim
that cannot reach Redis returns a lease never superseded (forwarded unfenced, counted,
logged); `fail_closed`: the claim raises and the caller gets a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from proxy.config.schema import OnRetry, OnUnavailable, RegistryConfig
from proxy.errors import RegistryUnavailable
from proxy.registry.base import BESIDE, Beside, Follow, Lease, Registry
from proxy.registry.book import Book, ref
from proxy.registry.genlog.log import GenerationLog
from proxy.registry.genlog.timing import CHECK_EVERY, DEAD_AFTER, READER_TTL
from proxy.registry.handshake import Handshake
from proxy.registry.listener import Subscriber
from proxy.registry.redisio import (
    COMMAND_TIMEOUT,
    Call,
    Client,
    Keys,
    connect,
    is_cluster,
    translate,
)
from proxy.registry.rounds import Batcher, send_round
from proxy.registry.scripts import CLAIM, CLAIM_OR_FOLLOW, REFRESH, RELEASE
from proxy.tasks import cancelled

log = logging.getLogger("streamfence")

WARN_EVERY = 5.0  # seconds between "forwarding unfenced" warnings while Redis is down


class RedisRegistry(Registry):
    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        self.fail_open = config.on_unavailable != OnUnavailable.FAIL_CLOSED
        self.ttl_ms = max(1, int(config.lease_ttl * 1000))
        self._client = connect(config.url)
        db = 0
        if isinstance(self._client, Redis):
            db = int(self._client.connection_pool.connection_kwargs.get("db", 0))
        self.keys = Keys(config.url, db)
        self.channel = self.keys.channel
        self._claim = self._client.register_script(CLAIM)
        self._claim_or_follow = self._client.register_script(CLAIM_OR_FOLLOW)
        self._release = self._client.register_script(RELEASE)
        self._refresh = self._client.register_script(REFRESH)
        # Claims and releases of concurrent requests go together (`rounds`): under load,
        # one round trip for many, which is when redis-py's per-command cost would tell.
        self._claims = Batcher(self._client, "claim")
        self._releases = Batcher(self._client, "release")
        self._book = Book()  # what this process holds, and what a claim does to it
        self._handshake = Handshake(self._book, self._publish, self.channel)
        self._unfenced = itertools.count(-1, -1)  # fail-open tokens: never a Redis token
        self._subscriber = Subscriber(
            self._client, self.channel, self._handshake.on_message, self._refresh_all
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._warned_at = -WARN_EVERY
        self._suppressed = 0
        self._log: GenerationLog | None = None
        self._writes: Client | None = None  # the log's own pool, made with the log
        self._reads: Client | None = None  # the log's blocking reads, made with the log

    def generation_log(self) -> GenerationLog:
        """The generation log (`genlog`), on this registry's Redis connection."""
        if self._log is None:
            # A pool of its own on one server: a busy process's log appends held every
            # pooled connection, and claims queued behind them until they timed out and
            # failed open, leaving the streams they should fence running. (A cluster
            # client's pools are unbounded, so one client does; a second one, new, hit the
            # slot-map race that `connection._Cluster` now avoids.)
            self._writes = self._client if is_cluster(self.config.url) else connect(self.config.url)
            self._reads = connect(
                self.config.url, command_timeout=COMMAND_TIMEOUT + CHECK_EVERY, queue=False
            )
            self._log = GenerationLog(self._writes, reads=self._reads)
        return self._log

    def watch(self, lease: Lease) -> None:
        """Fence `lease`, a generation of another process followed here, as soon as a newer
        claim of its turn is heard (its own process says so too, but later: in its log)."""
        self._book.watch(lease)

    def unwatch(self, lease: Lease) -> None:
        self._book.unwatch(lease)

    @staticmethod
    def entry_key(key: str) -> str:
        return Keys.entry(key)

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._subscriber.run(), name="streamfence-registry-subscriber"),
            asyncio.create_task(self._refresher(), name="streamfence-registry-refresh"),
        ]

    async def close(self) -> None:
        if not await cancelled(self._tasks):
            log.warning("streamfence: the registry's subscriber did not stop; left behind")
        for task in self._tasks:  # what ended one other than its cancellation: a bug
            if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
                raise exc
        self._tasks = []
        if self._background:
            _, late = await asyncio.wait(self._background, timeout=COMMAND_TIMEOUT)
            # Not left to run on a closed client (which would connect again) or to whoever
            # closes the event loop: cancelled here, and waited for, still bounded.
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=COMMAND_TIMEOUT)
        await self._claims.close()
        await self._releases.close()
        if self._log is not None:
            await self._log.close()
        for client in {c for c in (self._client, self._writes, self._reads) if c is not None}:
            await client.aclose()

    async def ready(self) -> bool:
        # Also under fail_open: readyz says "degraded" then, and still answers 200
        # (availability first), rather than hiding that nothing is fenced.
        return self.subscribed and await self.reachable()

    async def reachable(self) -> bool:
        try:
            with translate("ping"):
                await self._client.ping()
        except RegistryUnavailable:
            return False
        return True

    @property
    def subscribed(self) -> bool:
        """Claims made by other processes reach this one (the subscription is live)."""
        return self._subscriber.subscribed.is_set()

    async def wait_subscribed(self) -> None:
        """Until the claim subscription is live (tests, benchmarks)."""
        await self._subscriber.subscribed.wait()

    async def claim(self, key: str) -> Lease:
        args: list[str | int] = [self.ttl_ms, self.channel, key, uuid.uuid4().hex]
        lease = await self._claim_with(key, self._claim, args)
        assert isinstance(lease, Lease)
        return lease

    async def claim_or_follow(
        self, key: str, body_hash: str, streaming: bool, healthy_within: float, on_retry: OnRetry
    ) -> Lease | Follow | Beside:
        """One atomic step (scripts.CLAIM_OR_FOLLOW): follow the turn's generation in
        another process (`Follow`), go beside it (`BESIDE`), or claim a new one, whose
        generation log is created with the claim (`Lease`)."""
        store = self.generation_log().store
        args: list[str | int] = [self.ttl_ms, self.channel, key, store.prefix(key), body_hash]
        args += ["1" if streaming else "0", int(healthy_within * 1000), str(on_retry)]
        reader_id = uuid.uuid4().hex
        dead_after, reader_ttl = int(DEAD_AFTER * 1000), int(READER_TTL * 1000)
        args += [store.ttl_ms, store.maxlen, dead_after, reader_id, reader_ttl]
        answer: Lease | Follow | Beside = await self._claim_with(key, self._claim_or_follow, args)
        if isinstance(answer, Follow):
            return answer._replace(reader_id=reader_id)
        return answer

    async def _claim_with(self, key: str, script: AsyncScript, args: list[str | int]) -> Any:
        self._handshake.claiming(key)
        try:
            reply = await self._claim_shielded(key, script, args)  # errors: ours already
            early = self._handshake.newest_heard(key)
        except RegistryUnavailable:
            if not self.fail_open:
                raise
            return self._unfenced_lease(key)
        finally:
            self._handshake.claimed(key)
        if reply[0] == b"follow":
            quiet = int(reply[4]) / 1000 if len(reply) > 4 else 0.0
            return Follow(int(reply[1]), int(reply[2]), int(reply[3]), quiet=quiet)
        if reply[0] == b"beside":
            return BESIDE
        token_raw, attempt_raw, prev_raw = reply
        lease = Lease(key, int(token_raw), int(attempt_raw))
        own = self._book.claimed(lease, int(prev_raw))  # the replaced one, if ours: fenced
        if early is not None and early.token > lease.token:
            # Another process's newer claim was heard before this claim's own reply.
            lease.supersede(newer_attempt=early.attempt)
            self._handshake.ack(ref(lease))
        prev = (key, int(prev_raw))
        if not own and prev[1] and prev not in self._book.ended:
            try:
                await self._handshake.confirmed(prev, lease)
            except asyncio.CancelledError:
                self._spawn(self.release(lease))  # the caller is gone: so is its lease
                raise
        return lease

    async def _claim_shielded(
        self, key: str, script: AsyncScript, args: list[str | int]
    ) -> list[Any]:
        # The caller may be cancelled (its client left) after Redis ran the script: the
        # entry it created must not be left to linger for a whole TTL.
        keys = [self.keys.entry(key), self.keys.counter(key)]
        call = self._claims.submit((script, keys, args))
        try:
            reply: list[Any] = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: self._release_orphan(key, done))
            raise
        return reply

    def _release_orphan(self, key: str, call: asyncio.Future[Any]) -> None:
        if call.cancelled() or call.exception() is not None:
            return
        if call.result()[0] in (b"follow", b"beside"):
            return  # nothing was claimed
        orphan = Lease(key, int(call.result()[0]), int(call.result()[1]))
        self._book.ended.add(ref(orphan))
        self._spawn(self._release_entry(orphan))

    def _publish(self, message: str) -> None:
        async def publish() -> None:
            with contextlib.suppress(RegistryUnavailable), translate("confirm"):
                await self._client.publish(self.channel, message)

        self._spawn(publish())

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _unfenced_lease(self, key: str) -> Lease:
        if self.unavailable_hook is not None:
            self.unavailable_hook()
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY:
            also = f" (and {self._suppressed} more since then)" if self._suppressed else ""
            log.warning(
                "streamfence: registry unavailable, forwarding turn %s without fencing%s",
                key[:16],
                also,
            )
            self._warned_at, self._suppressed = now, 0
        else:
            self._suppressed += 1
        return Lease(key, next(self._unfenced), 1)

    async def release(self, lease: Lease) -> None:
        if lease.token < 0:
            return  # forwarded unfenced: never entered the registry
        if self._book.released(lease):
            await self._release_entry(lease)

    async def _release_entry(self, lease: Lease) -> None:
        try:
            keys = [self.entry_key(lease.key)]
            await self._releases.submit((self._release, keys, [str(lease.token)]))
        except RegistryUnavailable as exc:
            # The stream has ended either way; the entry expires with its TTL.
            log.debug("%s; turn %s left to expire", exc.message, lease.key[:16])

    def live_keys(self) -> int:
        return len(self._book)

    async def _refresher(self) -> None:
        every = max(0.05, self.ttl_ms / 3000)
        while True:
            await asyncio.sleep(every)
            try:
                await self._refresh_all()
            except RegistryUnavailable:
                pass  # entries live on until their TTL; the next round tries again
            except Exception:  # as in the subscriber: keep refreshing whatever happened
                log.exception("streamfence: refreshing registry entries failed")

    async def _refresh_all(self) -> None:
        """Extend the TTL of every entry this process holds, and fence any local holder
        that Redis says was superseded by a claim we did not hear about."""
        holders = self._book.holders()
        if not holders:
            return
        calls: list[Call] = [
            (self._refresh, [self.keys.entry(h.key)], [str(h.token), self.ttl_ms]) for h in holders
        ]
        failed: RegistryUnavailable | None = None
        replies = await send_round(self._client, calls, "refresh")
        for lease, reply in zip(holders, replies, strict=True):
            if isinstance(reply, RegistryUnavailable):
                failed = reply
                continue
            token, attempt = reply
            if token is not None and int(token) > lease.token:
                lease.supersede(newer_attempt=int(attempt))
                self._handshake.ack(ref(lease))
        if failed is not None:
            raise failed  # a catch-up after (re)subscribing is complete, or tried again
