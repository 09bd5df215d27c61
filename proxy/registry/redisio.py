"""Connecting to Redis (one server or a Redis Cluster) and naming the registry's keys.

A cluster is chosen by the URL scheme: `redis+cluster://host:port` (or `rediss+cluster://`)
names any one node; the client discovers the others. Every key of one turn carries the
turn key as its hash tag (`streamfence:{<turn>}:...`), so each script touches one slot.

Fencing tokens need a counter the claim script can touch: on one server that is one
global counter; in a cluster it is one counter per hash slot, named with a hash tag that
hashes to the turn's own slot (found once per process: `_slot_tags`). Tokens then never
repeat for a key (its slot's counter only grows, and is floored by the clock if lost), but
two keys in different slots may share a token: the registry keys its books by
(turn, token), never by token alone.

Redis errors become `RegistryUnavailable` here (`translate`), and only here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from binascii import crc_hqx
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from proxy.errors import RegistryUnavailable

PREFIX = "streamfence:"
SLOTS = 16384
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
CONNECT_TIMEOUT = 0.5  # a claim sits in front of the first byte: fail fast, not late
COMMAND_TIMEOUT = 1.0
RETRY_AFTER = 0.1  # a call that failed is tried again this soon (patiently)
# redis-py's asyncio pools default to 100 connections and then raise at once instead of
# waiting (redis-py 8 for a standalone server too): a burst of concurrent requests past it
# had its claims fail open, forwarded unfenced. A standalone server's pool waits for a free
# connection instead (a burst of hundreds of new connections timed out connecting); a
# cluster client's pools (one per node) cannot wait, and are unbounded.
POOL_SIZE = 64
UNBOUNDED = 2**31

T = TypeVar("T")

Client = Redis | RedisCluster


class _Cluster(RedisCluster):
    """redis-py 8.1's cluster client picks a command's route before it sets up its slot map
    (when new, and again after it closed itself on an error): a keyed command then goes to
    a random node, which answers MOVED. Every fifth MOVED, its default `reinitialize_steps`
    closed the client again, with every connection in use, the subscription's too: a burst
    of claims on a new client failed open (seen in CI). Here the map comes first, and a
    MOVED moves its slot only."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        await self.initialize()  # at once when it has a map
        return await super().execute_command(*args, **kwargs)


def is_cluster(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def connect(url: str, *, command_timeout: float = COMMAND_TIMEOUT, queue: bool = True) -> Client:
    """A client. `queue`: on a standalone server, a command waits for one of POOL_SIZE
    connections (short commands); else the pool opens one per concurrent command (blocking
    reads, each holding its connection for the length of its block)."""
    options: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "socket_timeout": command_timeout,
    }
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        plain = CLUSTER_SCHEMES[scheme] + url[len(scheme) :]
        # Redirections (MOVED/ASK) are followed by the client; one retry (after which it
        # reloads the slot map), then a node that is down fails like a standalone server.
        return _Cluster.from_url(
            plain,
            retry=Retry(NoBackoff(), 1),
            max_connections=UNBOUNDED,
            reinitialize_steps=0,
            **options,
        )
    # One retry, on a connection error only: after Redis restarts, each pooled connection
    # is dead once. A timeout is not retried: the fail mode decides.
    retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    if not queue:
        return Redis.from_url(url, retry=retry, max_connections=UNBOUNDED, **options)
    pool = BlockingConnectionPool.from_url(
        url, max_connections=POOL_SIZE, timeout=command_timeout, retry=retry, **options
    )
    return Redis.from_pool(pool)  # owned: closed with the client


def slot(key: str) -> int:
    """The hash slot of every key of turn `key`."""
    return key_slot(Keys.entry(key).encode())


@functools.cache
def _slot_tags() -> tuple[str, ...]:
    """For each hash slot, a short tag that hashes to it (~170,000 CRCs, once, ~50 ms)."""
    tags: list[str | None] = [None] * SLOTS
    left, n = SLOTS, 0
    while left:
        tag = str(n)
        s = crc_hqx(tag.encode(), 0) % SLOTS
        if tags[s] is None:
            tags[s] = tag
            left -= 1
        n += 1
    return tuple(t for t in tags if t is not None)


class Keys:
    """The names of everything the registry keeps in Redis."""

    def __init__(self, url: str, db: int = 0) -> None:
        self.cluster = is_cluster(url)
        if self.cluster:
            _slot_tags()  # at startup, not in front of the first claim
        # Pub/sub ignores the database number: keep deployments on other dbs apart.
        self.channel = f"{PREFIX}{db}:claims"

    @staticmethod
    def entry(key: str) -> str:
        return f"{PREFIX}{{{key}}}:turn"

    def counter(self, key: str) -> str:
        if not self.cluster:
            return f"{PREFIX}token"
        return f"{PREFIX}{{{_slot_tags()[slot(key)]}}}:token"


BATCH = 64  # script calls in flight at once on a cluster (no cross-node pipeline there)

Call = tuple[AsyncScript, list[str], list[Any]]  # a script, its keys, its args


async def run_scripts(client: Client, calls: Sequence[Call], *, load: bool = True) -> list[Any]:
    """Each call's reply, or its own error (a RedisError) in its place. One round trip for
    them all on one server (a pipeline of EVALSHA: redis-py's script pipelines ask SCRIPT
    EXISTS first, a second round trip every time; a script Redis does not have is loaded
    and its calls sent again); on a cluster, whose keys live on several nodes, concurrent
    calls in batches. A failure of the connection itself raises."""
    if not isinstance(client, Redis):
        replies: list[Any] = []
        for i in range(0, len(calls), BATCH):
            batch = calls[i : i + BATCH]
            replies += await asyncio.gather(
                *(script(keys=k, args=a) for script, k, a in batch), return_exceptions=True
            )
        return replies
    async with client.pipeline(transaction=False) as pipe:
        for script, keys, args in calls:
            await pipe.evalsha(script.sha, len(keys), *keys, *args)
        replies = list(await pipe.execute(raise_on_error=False))
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing and load:
        for source in {calls[i][0].script for i in missing}:
            await client.script_load(source)
        again = await run_scripts(client, [calls[i] for i in missing], load=False)
        for i, reply in zip(missing, again, strict=True):
            replies[i] = reply
    return replies


@contextlib.contextmanager
def translate(what: str) -> Iterator[None]:
    """The one boundary where redis (and socket) errors become the project's own."""
    try:
        yield
    except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
        raise unavailable(what, exc) from exc


def unavailable(what: str, exc: BaseException) -> RegistryUnavailable:
    return RegistryUnavailable(
        f"streamfence: the shared turn registry (Redis) is unavailable ({what}: "
        f"{type(exc).__name__})"
    )


async def patiently(
    call: Callable[[], Awaitable[T]], what: str, *, answered_at: float, within: float
) -> T:
    """`call`, tried again while Redis last answered the caller less than `within` seconds
    ago (`answered_at`, time.monotonic()); then its RegistryUnavailable. Under load (a busy
    event loop, a burst of new pooled connections) one call can time out while Redis is
    fine: a caller that gives up only after a silence that long ends nothing healthy."""
    while True:
        try:
            with translate(what):
                return await call()
        except RegistryUnavailable:
            if time.monotonic() - answered_at > within:
                raise
        await asyncio.sleep(RETRY_AFTER)
