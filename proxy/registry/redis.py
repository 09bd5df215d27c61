"""The Redis registry: one turn registry shared by every process that points at one Redis.

Claiming runs one Lua script: take a fencing token, make it the key's holder (with a TTL,
so a crashed process leaves nothing behind for longer than `lease_ttl`) and publish the
claim with the token of the holder it replaced. Each process holds one subscription; a
claim message supersedes the local lease it replaced, so the per-event check stays a local
attribute read. That process then publishes an acknowledgement, and the claim returns only
once the replaced attempt's process has confirmed (or after ACK_WAIT, if it is gone): so,
as within one process, no event of the older attempt is started after the newer one is
accepted. Only a retry whose predecessor lives in another process waits for this.

Tokens come from one counter that never goes below Redis's clock in microseconds: a Redis
restarted without its data still hands out tokens above every token issued before.

Redis errors become `RegistryUnavailable` here, and only here. `fail_open`: a claim that
cannot reach Redis returns a lease never superseded (forwarded unfenced, counted, logged);
`fail_closed`: the claim raises and the caller gets a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from proxy.config import RegistryConfig
from proxy.errors import RegistryUnavailable
from proxy.registry.base import Lease, Registry
from proxy.registry.scripts import CLAIM, REFRESH, RELEASE

log = logging.getLogger("streamfence")

PREFIX = "streamfence:"
CONNECT_TIMEOUT = 0.5  # a claim sits in front of the first byte: fail fast, not late
COMMAND_TIMEOUT = 1.0
ACK_WAIT = 0.05  # the longest a claim waits for another process to confirm a fence
RECONNECT_MIN, RECONNECT_MAX = 0.05, 0.5
IDLE_PING = 5.0  # seconds without traffic before the subscriber checks its connection
WARN_EVERY = 5.0  # seconds between "forwarding unfenced" warnings while Redis is down


@dataclass(slots=True)
class _Local:
    holder: Lease  # the newest lease this process holds for the key
    live: int  # claimed here and not yet released, superseded ones included


class _Recent:
    """The last `size` tokens seen: the handshake only ever looks a few milliseconds back."""

    def __init__(self, size: int = 4096) -> None:
        self._set: set[int] = set()
        self._order: deque[int] = deque()
        self._size = size

    def add(self, token: int) -> None:
        if token not in self._set:
            self._set.add(token)
            self._order.append(token)
            if len(self._order) > self._size:
                self._set.discard(self._order.popleft())

    def __contains__(self, token: int) -> bool:
        return token in self._set


@contextlib.contextmanager
def _translate(what: str) -> Iterator[None]:
    """The one boundary where redis (and socket) errors become the project's own."""
    try:
        yield
    except (RedisError, OSError, TimeoutError) as exc:
        raise RegistryUnavailable(
            f"streamfence: the shared turn registry (Redis) is unavailable ({what}: "
            f"{type(exc).__name__})"
        ) from exc


class RedisRegistry(Registry):
    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        self.fail_open = config.on_unavailable != "fail_closed"
        self.ttl_ms = max(1, int(config.lease_ttl * 1000))
        self._client: Redis = Redis.from_url(
            config.url,
            socket_connect_timeout=CONNECT_TIMEOUT,
            socket_timeout=COMMAND_TIMEOUT,
            # One retry, on a connection error only: after Redis restarts, each pooled
            # connection is dead once. A timeout is not retried: the fail mode decides.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        db = self._client.connection_pool.connection_kwargs.get("db", 0)
        # Pub/sub ignores the database number: keep deployments on other dbs apart.
        self.channel = f"{PREFIX}{db}:claims"
        self._counter = f"{PREFIX}token"
        self._claim = self._client.register_script(CLAIM)
        self._release = self._client.register_script(RELEASE)
        self._refresh = self._client.register_script(REFRESH)
        self._local: dict[str, _Local] = {}
        self._by_token: dict[int, Lease] = {}  # claimed here and not yet released
        self._ended = _Recent()  # released here: confirmed as fenced if asked
        self._acked = _Recent()  # confirmed fenced by whichever process held them
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._pending: dict[str, int] = {}  # claims in flight per key
        self._early: dict[str, tuple[int, int]] = {}  # newest claim heard for a pending key
        self._unfenced = itertools.count(-1, -1)  # fail-open tokens: never a Redis token
        self._subscribed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._warned_at = -WARN_EVERY
        self._suppressed = 0

    @staticmethod
    def entry_key(key: str) -> str:
        return f"{PREFIX}turn:{key}"

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._subscriber(), name="streamfence-registry-subscriber"),
            asyncio.create_task(self._refresher(), name="streamfence-registry-refresh"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._background:
            await asyncio.wait(self._background, timeout=COMMAND_TIMEOUT)
        await self._client.aclose()

    async def ready(self) -> bool:
        if self.fail_open:
            # Availability first: without Redis this process still serves, unfenced (logged
            # and counted). Reporting "not ready" would take every replica out of rotation.
            return True
        if not self._subscribed.is_set():
            return False
        try:
            with _translate("ping"):
                await self._client.ping()
        except RegistryUnavailable:
            return False
        return True

    @property
    def subscribed(self) -> bool:
        """Claims made by other processes reach this one (the subscription is live)."""
        return self._subscribed.is_set()

    async def wait_subscribed(self) -> None:
        """Until the claim subscription is live (tests, benchmarks)."""
        await self._subscribed.wait()

    async def claim(self, key: str) -> Lease:
        self._pending[key] = self._pending.get(key, 0) + 1
        try:
            with _translate("claim"):
                token_raw, attempt_raw, prev_raw = await self._claim_shielded(key)
            early = self._early.get(key)
        except RegistryUnavailable:
            if not self.fail_open:
                raise
            return self._unfenced_lease(key)
        finally:
            left = self._pending[key] - 1
            if left:
                self._pending[key] = left
            else:
                del self._pending[key]
                self._early.pop(key, None)
        lease = Lease(key, int(token_raw), int(attempt_raw))
        self._by_token[lease.token] = lease
        local = self._local.get(key)
        if local is None:
            self._local[key] = _Local(lease, 1)
        else:
            local.live += 1
            if local.holder.token < lease.token:
                local.holder.supersede(newer_attempt=lease.attempt)
                local.holder = lease
            else:  # a later claim of this process was answered first
                lease.supersede(newer_attempt=local.holder.attempt)
        if early is not None and early[0] > lease.token:
            # Another process's newer claim was heard before this claim's own reply.
            lease.supersede(newer_attempt=early[1])
            self._ack(lease.token)
        prev = int(prev_raw)
        replaced = self._by_token.get(prev)
        if replaced is not None:  # this process's own: fenced here and now
            replaced.supersede(newer_attempt=lease.attempt)
        elif prev and prev not in self._ended:
            try:
                await self._confirmed(prev, lease)
            except asyncio.CancelledError:
                self._spawn(self.release(lease))  # the caller is gone: so is its lease
                raise
        return lease

    async def _claim_shielded(self, key: str) -> list[Any]:
        # The caller may be cancelled (its client left) after Redis ran the script: the
        # entry it created must not be left to linger for a whole TTL.
        call = asyncio.ensure_future(
            self._claim(
                keys=[self.entry_key(key), self._counter], args=[self.ttl_ms, self.channel, key]
            )
        )
        try:
            reply: list[Any] = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: self._release_orphan(key, done))
            raise
        return reply

    def _release_orphan(self, key: str, call: asyncio.Future[Any]) -> None:
        if call.cancelled() or call.exception() is not None:
            return
        orphan = Lease(key, int(call.result()[0]), int(call.result()[1]))
        self._ended.add(orphan.token)
        self._spawn(self._release_entry(orphan))

    async def _confirmed(self, prev: int, lease: Lease) -> None:
        """Until the process holding `prev` (replaced by `lease`) says it is fenced."""
        if prev in self._acked:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(prev, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, ACK_WAIT)
        except TimeoutError:
            # Its process is gone, or cut off from Redis: nothing to wait for any longer.
            log.warning(
                "streamfence: turn %s: the older attempt's process did not confirm its fence "
                "within %d ms; going ahead",
                lease.key[:16],
                ACK_WAIT * 1000,
            )
        finally:
            waiters = self._waiters.get(prev, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._waiters.pop(prev, None)

    def _ack(self, token: int) -> None:
        """Tell the claimer that replaced `token` that its attempt is fenced here."""

        async def publish() -> None:
            with contextlib.suppress(RegistryUnavailable), _translate("confirm"):
                await self._client.publish(self.channel, f"f {token}")

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
        if self._by_token.pop(lease.token, None) is None:
            return  # released already
        self._ended.add(lease.token)
        local = self._local.get(lease.key)
        if local is not None:
            local.live -= 1
            if local.live <= 0:
                del self._local[lease.key]
        await self._release_entry(lease)

    async def _release_entry(self, lease: Lease) -> None:
        try:
            with _translate("release"):
                await self._release(keys=[self.entry_key(lease.key)], args=[str(lease.token)])
        except RegistryUnavailable as exc:
            # The stream has ended either way; the entry expires with its TTL.
            log.debug("%s; turn %s left to expire", exc.message, lease.key[:16])

    def live_keys(self) -> int:
        return len(self._local)

    def _heard(self, token: int, attempt: int, prev: int, key: str) -> None:
        """A claim made anywhere (this process included) for `key`, replacing `prev`."""
        local = self._local.get(key)
        if local is not None and local.holder.token < token:
            local.holder.supersede(newer_attempt=attempt)
        replaced = self._by_token.get(prev)
        if replaced is not None:
            replaced.supersede(newer_attempt=attempt)
            if token not in self._by_token:  # a claim of this process needs no message
                self._ack(prev)
        elif prev in self._ended:
            self._ack(prev)
        if key in self._pending:
            early = self._early.get(key)
            if early is None or early[0] < token:
                self._early[key] = (token, attempt)

    def _confirmed_by_holder(self, token: int) -> None:
        self._acked.add(token)
        for waiter in self._waiters.pop(token, []):
            if not waiter.done():
                waiter.set_result(None)

    def _on_message(self, message: dict[str, Any]) -> None:
        if message.get("type") != "message":
            return
        try:
            kind, _, rest = message["data"].decode().partition(" ")
            if kind == "c":
                token, attempt, prev, key = rest.split(" ", 3)
                self._heard(int(token), int(attempt), int(prev), key)
            elif kind == "f":
                self._confirmed_by_holder(int(rest))
        except (ValueError, UnicodeDecodeError):
            log.warning("streamfence: ignored a malformed message on %s", self.channel)

    async def _subscriber(self) -> None:
        delay = RECONNECT_MIN
        while True:
            pubsub: PubSub = self._client.pubsub()
            try:
                with _translate("subscribe"):
                    await self._listen(pubsub)
            except RegistryUnavailable as exc:
                if self._subscribed.is_set():
                    log.warning("%s; fencing across processes paused", exc.message)
            except Exception:  # a bug here must not end fencing across processes for good
                log.exception("streamfence: the registry subscriber failed; reconnecting")
            finally:
                if self._subscribed.is_set():
                    delay = RECONNECT_MIN  # it was up: retry soon, back off from there
                self._subscribed.clear()
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX)

    async def _listen(self, pubsub: PubSub) -> None:
        await pubsub.subscribe(self.channel)
        while True:  # the confirmation: from here on no claim message is missed
            message = await pubsub.get_message(timeout=COMMAND_TIMEOUT)
            if message is None:
                raise TimeoutError("no subscribe confirmation")
            if message["type"] == "subscribe":
                break
            self._on_message(message)
        await self._refresh_all()  # catch up on claims made while we were not listening
        if not self._subscribed.is_set():
            log.info("streamfence: subscribed to %s", self.channel)
        self._subscribed.set()
        idle = 0.0
        while True:
            message = await pubsub.get_message(timeout=1.0)
            if message is not None:
                idle = 0.0
                self._on_message(message)
                continue
            idle += 1.0
            if idle == IDLE_PING:
                await pubsub.ping()  # its reply arrives as a message and resets `idle`
            elif idle > IDLE_PING + COMMAND_TIMEOUT * 2:
                raise TimeoutError("the subscription stopped answering")

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
        holders = [local.holder for local in self._local.values() if not local.holder.superseded]
        if not holders:
            return
        with _translate("refresh"):
            async with self._client.pipeline(transaction=False) as pipe:
                for lease in holders:
                    await self._refresh(
                        keys=[self.entry_key(lease.key)],
                        args=[str(lease.token), self.ttl_ms],
                        client=pipe,
                    )
                replies = await pipe.execute()
        for lease, (token, attempt) in zip(holders, replies, strict=True):
            if token is not None and int(token) > lease.token:
                lease.supersede(newer_attempt=int(attempt))
                self._ack(lease.token)
