"""The registry's one subscription per process: claim messages and fence confirmations.

Plain pub/sub, on one server and in a cluster alike: a cluster forwards every published
message to every node, so one subscription on any node hears every claim. Sharded pub/sub
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
from collections.abc import Awaitable, Callable

from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from proxy.errors import RegistryUnavailable
from proxy.registry.connection import COMMAND_TIMEOUT, Client, translate

log = logging.getLogger("streamfence")

RECONNECT_MIN, RECONNECT_MAX = 0.05, 0.5
IDLE_PING = 5.0  # seconds without traffic before the subscriber checks its connection


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

    async def run(self) -> None:
        delay = RECONNECT_MIN
        while True:
            pubsub: PubSub | None = None
            try:
                with translate("subscribe"):
                    if isinstance(self.client, RedisCluster):
                        await self.client.initialize()  # its pubsub needs the slot map
                    pubsub = self.client.pubsub()
                    await self._listen(pubsub)
            except RegistryUnavailable as exc:
                if self.subscribed.is_set():
                    log.warning("%s; fencing across processes paused", exc.message)
            except Exception:  # a bug here must not end fencing across processes for good
                log.exception("streamfence: the registry subscriber failed; reconnecting")
            finally:
                if self.subscribed.is_set():
                    delay = RECONNECT_MIN  # it was up: retry soon, back off from there
                self.subscribed.clear()
                if pubsub is not None:
                    with contextlib.suppress(RedisError, RedisClusterException, OSError):
                        await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX)

    def _deliver(self, message: dict[str, object]) -> None:
        data = message.get("data")
        if message.get("type") == "message" and isinstance(data, bytes):
            self.on_message(data)

    async def _listen(self, pubsub: PubSub) -> None:
        await pubsub.subscribe(self.channel)
        while True:  # the confirmation: from here on no claim message is missed
            message = await pubsub.get_message(timeout=COMMAND_TIMEOUT)
            if message is None:
                raise TimeoutError("no subscribe confirmation")
            if message["type"] == "subscribe":
                break
            self._deliver(message)
        await self.on_subscribed()  # catch up on claims made while we were not listening
        if not self.subscribed.is_set():
            log.info("streamfence: subscribed to %s", self.channel)
        self.subscribed.set()
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
