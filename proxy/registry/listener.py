"""The registry's one subscription per process: claim messages and fence confirmations.

Plain pub/sub, on one server and in a cluster alike: a cluster forwards every published
message to every node (one subscription per master keeps the bus out of the fast path:
see `_open`). Sharded pub/sub
(Redis 7) would keep a message on its slot's node, but a process would then hold 16384
shard subscriptions spread over the masters and follow them through every resharding;
for one short message per claim, the broadcast is the cheaper side of that trade.

Reconnects with backoff; after every (re)subscription the registry catches up on the claims
it may have missed (`on_subscribed`), and only then reports itself subscribed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from proxy.errors import RegistryUnavailable
from proxy.registry.redisio import COMMAND_TIMEOUT, Client, translate
from proxy.tasks import cancelled

log = logging.getLogger("streamfence")

RECONNECT_MIN, RECONNECT_MAX = 0.05, 0.5
IDLE_PING = 5.0  # seconds without traffic before the subscriber checks its connection
T = TypeVar("T", bound=Hashable)


class Recent(Generic[T]):
    """The last `size` items seen: the handshake only ever looks a few milliseconds back."""

    def __init__(self, size: int = 4096) -> None:
        self._set: set[T] = set()
        self._order: deque[T] = deque()
        self._size = size

    def add(self, item: T) -> None:
        if item not in self._set:
            self._set.add(item)
            self._order.append(item)
            if len(self._order) > self._size:
                self._set.discard(self._order.popleft())

    def __contains__(self, item: object) -> bool:
        return item in self._set


class Subscriber:
    def __init__(
        self,
        client: Client,
        channel: str,
        on_message: Callable[[bytes], None],
        on_subscribed: Callable[[], Awaitable[None]],
    ) -> None:
        self.client = client
        self.channel = channel
        self.on_message = on_message
        self.on_subscribed = on_subscribed
        self.subscribed = asyncio.Event()
        # In a cluster each message arrives once per master: the repeats are dropped.
        self._seen: Recent[bytes] | None = (
            Recent(16384) if isinstance(client, RedisCluster) else None
        )

    async def run(self) -> None:
        delay = RECONNECT_MIN
        while True:
            pubsubs: list[PubSub] = []
            try:
                with translate("subscribe"):
                    pubsubs = await self._open()
                    await self._listen(pubsubs)
            except RegistryUnavailable as exc:
                if self.subscribed.is_set():
                    log.warning("%s; fencing across processes paused", exc.message)
            except Exception:  # a bug here must not end fencing across processes for good
                log.exception("streamfence: the registry subscriber failed; reconnecting")
            finally:
                if self.subscribed.is_set():
                    delay = RECONNECT_MIN  # it was up: retry soon, back off from there
                self.subscribed.clear()
                for pubsub in pubsubs:
                    with contextlib.suppress(RedisError, RedisClusterException, OSError):
                        await pubsub.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX)

    async def _open(self) -> list[PubSub]:
        if not isinstance(self.client, RedisCluster):
            return [self.client.pubsub()]
        await self.client.initialize()  # the slot map: which nodes are the masters
        # One subscription per master. A claim is published by the node that runs its
        # script, and reaches that node's subscribers at once; the copies the cluster bus
        # forwards to the other nodes come later (tens of ms at worst, measured) and are
        # dropped as repeats. With one subscription on one node, every claim of the other
        # masters would wait for the bus, and the fence handshake (ACK_WAIT) with it.
        return [self.client.pubsub(node=node) for node in self.client.get_primaries()]

    def _deliver(self, message: dict[str, object]) -> None:
        data = message.get("data")
        if message.get("type") != "message" or not isinstance(data, bytes):
            return
        if self._seen is not None:
            if data in self._seen:
                return
            self._seen.add(data)
        self.on_message(data)

    async def _confirmed(self, pubsub: PubSub) -> None:
        await pubsub.subscribe(self.channel)
        while True:  # the confirmation: from here on no claim message is missed
            message = await pubsub.get_message(timeout=COMMAND_TIMEOUT)
            if message is None:
                raise TimeoutError("no subscribe confirmation")
            if message["type"] == "subscribe":
                return
            self._deliver(message)

    async def _listen(self, pubsubs: list[PubSub]) -> None:
        for pubsub in pubsubs:
            await self._confirmed(pubsub)
        await self.on_subscribed()  # catch up on claims made while we were not listening
        if not self.subscribed.is_set():
            log.info("streamfence: subscribed to %s", self.channel)
        self.subscribed.set()
        tasks = [asyncio.ensure_future(self._receive(pubsub)) for pubsub in pubsubs]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises what ended it: every subscription starts over
        finally:
            await cancelled(tasks)

    async def _receive(self, pubsub: PubSub) -> None:
        idle = 0.0
        while True:
            message = await pubsub.get_message(timeout=1.0)
            if message is not None:
                idle = 0.0
                self._deliver(message)
                continue
            idle += 1.0
            if idle == IDLE_PING:
                await pubsub.ping()  # its reply arrives as a message and resets `idle`
            elif idle > IDLE_PING + COMMAND_TIMEOUT * 2:
                raise TimeoutError("the subscription stopped answering")
