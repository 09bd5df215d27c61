"""The Redis registry against a real redis-server: fencing across processes, stale
releases, expiry after a crash, Redis dying mid-run in both fail modes, and a stress run
spread over two proxies. Proxies run as real subprocesses (`python -m proxy`) where the
point is two processes, and in-process (separate registries, one event loop) where the
test needs to look inside them.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from proxy.config.load import ConfigError, load
from proxy.config.schema import OnRetry, RegistryConfig
from proxy.registry.base import Follow, Lease
from proxy.registry.handshake import ACK_WAIT
from proxy.registry.redis import RedisRegistry
from proxy.registry.rounds import ROUNDS
from tests.conftest import Proxy, ProxyFactory
from tests.netlink import Link
from tests.probes import until
from tests.redis_server import (
    REDIS_SERVER,
    RedisClusterServer,
    RedisServer,
    Server,
    redis_client,
    registries,
)
from tests.scripted import ScriptedUpstream, Seen, free_port
from tests.sse_client import Event, chat_body, events, open_stream

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

CHAT = "/v1/chat/completions"
ROOT = Path(__file__).resolve().parents[2]


async def _subscribers(server: Server, channel: str = "streamfence:0:claims") -> list[int]:
    """Subscribers of `channel` on each node (in a cluster, each process subscribes on
    every master)."""
    ports = server.ports if isinstance(server, RedisClusterServer) else [server.port]
    counts = []
    for port in ports:
        node = Redis(host="127.0.0.1", port=port)
        try:
            [(_, count)] = await node.pubsub_numsub(channel)
            counts.append(int(count))
        finally:
            await node.aclose()
    return counts


def _redis_overrides(server: Server, **extra: Any) -> dict[str, Any]:
    return {"registry.backend": "redis", "registry.url": server.url, **extra}


@asynccontextmanager
async def redis_proxy(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream, server: Server, **extra: Any
) -> AsyncIterator[Proxy]:
    async with make_proxy(upstream.url, **_redis_overrides(server, **extra)) as proxy:
        registry = proxy.runtime.registry
        assert isinstance(registry, RedisRegistry)
        await asyncio.wait_for(registry.wait_subscribed(), 5)
        yield proxy


class ProxyProcess:
    """`python -m proxy` as a real subprocess sharing the test's Redis."""

    def __init__(
        self, upstream_url: str, redis_url: str, log: Path, *extra: str, **env: str
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
        args = [sys.executable, "-m", "proxy", "--upstream", upstream_url]
        args += ["--port", str(self.port), "--registry-url", redis_url, "--log-level", "warning"]
        args += extra
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env={**clean, **env},
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )

    async def ready(self) -> None:
        async def check() -> bool:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                async with httpx.AsyncClient(timeout=1) as client:
                    r = await client.get(self.url + "/_streamfence/readyz")
                return r.status_code == 200
            except httpx.HTTPError:
                return False

        await until(check, within=20, every=0.05)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


@asynccontextmanager
async def proxy_processes(
    n: int, upstream: ScriptedUpstream, server: Server, tmp_path: Path, **env: str
) -> AsyncIterator[list[ProxyProcess]]:
    procs = [
        ProxyProcess(upstream.url, server.url, tmp_path / f"proxy-{i}.log", **env) for i in range(n)
    ]
    try:
        await asyncio.gather(*(p.ready() for p in procs))
        await _wait_subscribers(server, n)
        yield procs
    finally:
        for p in procs:
            p.stop()


async def _wait_subscribers(server: Server, n: int) -> None:
    """Until n processes listen for claims (readyz does not say so in fail_open mode)."""

    async def subscribed() -> bool:
        return all(count == n for count in await _subscribers(server))

    await until(subscribed, within=20)


def _superseded(event: Event) -> bool:
    body = event.json
    return bool(body.get("error", {}).get("code") == "stream_superseded") and "[DONE]" not in str(
        body
    )


def _seen(upstream: ScriptedUpstream, prefix: str) -> Seen:
    return next(s for s in upstream.seen if s.script.prefix == prefix)


async def _open_gated(
    stack: AsyncExitStack, client: httpx.AsyncClient, turn: str, prefix: str
) -> tuple[httpx.Response, AsyncIterator[Event]]:
    """A streaming attempt that has delivered its first event and waits upstream."""
    response = await open_stream(
        stack, client, CHAT, chat_body(gated=True, tokens=5, prefix=prefix), {"X-Turn-Id": turn}
    )
    assert response.status_code == 200
    stream = events(response)
    first = await anext(stream)
    assert first.text == f"{prefix}0 "
    return response, stream


async def _arrival(upstream: ScriptedUpstream, prefix: str) -> Seen:
    """Until the upstream has received the request whose script has this prefix."""
    while True:
        for seen in upstream.seen:
            if seen.script.prefix == prefix:
                return seen
        upstream.arrived.clear()
        await upstream.arrived.wait()


async def _fence_once(
    a: httpx.AsyncClient, b: httpx.AsyncClient, upstream: ScriptedUpstream, turn: str
) -> float:
    """An attempt through `a` fenced by a retry through `b`: checks every outcome and
    returns the fence latency (retry sent -> old upstream closed)."""
    async with AsyncExitStack() as stack:
        a_resp, a_events = await _open_gated(stack, a, turn, f"{turn}-A")
        seen_a = _seen(upstream, f"{turn}-A")
        sent = time.perf_counter()
        b_task = asyncio.create_task(
            b.post(
                CHAT,
                json=chat_body(stream=False, prefix=f"{turn}-B"),
                headers={"X-Turn-Id": turn},
            )
        )
        await asyncio.wait_for(_arrival(upstream, f"{turn}-B"), 5)
        # B was accepted before it was forwarded. An event A's upstream sends from now on
        # must not reach A's client (CONTRACT 2.1), whichever process A lives in.
        seen_a.release(1)
        await asyncio.wait_for(seen_a.closed.wait(), 5)
        assert seen_a.closed_at is not None
        latency = seen_a.closed_at - sent
        rest = [e async for e in a_events]
        b_resp = await b_task
    assert b_resp.status_code == 200
    assert b_resp.headers["x-streamfence-attempt"] == "2"
    assert a_resp.headers["x-streamfence-attempt"] == "1"
    assert len(rest) == 1 and _superseded(rest[0]), rest
    assert seen_a.events_sent <= 2 and not seen_a.finished
    return latency


# -- the registry itself ---------------------------------------------------------------


async def test_claims_fence_across_registries_and_stale_release_keeps_the_newer(
    redis_server: Server,
) -> None:
    config = RegistryConfig(backend="redis", url=redis_server.url)
    a, b = RedisRegistry(config), RedisRegistry(config)
    await a.start()
    await b.start()
    try:
        await asyncio.wait_for(asyncio.gather(a.wait_subscribed(), b.wait_subscribed()), 5)
        l1 = await a.claim("k")
        fenced = asyncio.Event()
        l1.on_superseded(fenced.set)
        l2 = await b.claim("k")
        await asyncio.wait_for(fenced.wait(), 1)
        assert (l1.attempt, l2.attempt) == (1, 2)
        assert l1.newer_attempt == 2 and not l2.superseded
        assert l2.token > l1.token

        async with redis_client(redis_server) as r:
            entry = RedisRegistry.entry_key("k")
            await a.release(l1)  # stale: l2 holds the key
            assert await r.hget(entry, "token") == str(l2.token).encode()
            l3 = await a.claim("k")
            assert l3.attempt == 3
            await b.release(l2)  # stale again, from the other process
            assert await r.hget(entry, "token") == str(l3.token).encode()
            ttl = await r.pttl(entry)
            assert 0 < ttl <= 3_600_000
            await a.release(l3)  # the holder: the key goes
            assert await r.exists(entry) == 0
        assert a.live_keys() == 0 and b.live_keys() == 0
        l4 = await b.claim("k")
        assert l4.attempt == 1  # restarted: no live attempt
        assert l4.token > l3.token  # but tokens never repeat
        await b.release(l4)
    finally:
        await a.close()
        await b.close()


async def test_a_burst_of_concurrent_claims_is_never_forwarded_unfenced(
    redis_server: Server,
) -> None:
    # redis-py 8's asyncio pool raises at once when 100 connections (its default) are in
    # use, which a burst of concurrent requests reaches: every claim past it failed open,
    # forwarded unfenced, and nothing fenced it when its turn was retried (a B5-style load
    # with the Redis registry: 146 of 500 turns).
    # On a cluster, redis-py 8.1 routed the commands of a client with no slot map yet to a
    # random node; every fifth MOVED it closed itself, with the connections of the claims in
    # flight and of the subscription: claims failed open (seen in CI). Counted by the nodes
    # themselves (Redis's errorstats), so this holds without the load that made it fail.
    registry = RedisRegistry(RegistryConfig(backend="redis", url=redis_server.url))
    failed_open: list[None] = []  # one per claim forwarded unfenced
    registry.unavailable_hook = lambda: failed_open.append(None)
    await _reset_stats(redis_server)
    await registry.start()
    try:
        run = uuid.uuid4().hex[:8]  # the shared cluster outlives this test's keys
        leases = await asyncio.gather(*(registry.claim(f"burst-{run}-{i}") for i in range(300)))
        assert not failed_open
        assert all(lease.token > 0 for lease in leases)  # every one entered Redis
        await asyncio.gather(*(registry.release(lease) for lease in leases))
        assert await _redirections(redis_server) == 0
    finally:
        await registry.close()


async def test_a_resharded_cluster_moves_claims_without_dropping_any(
    cluster_server: RedisClusterServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A slot map gone stale (the cluster resharded) is mended slot by slot from the MOVED
    answers. redis-py's default closed the whole client every fifth MOVED instead, with the
    connections of the claims in flight and of the subscription."""
    registry = RedisRegistry(RegistryConfig(backend="redis", url=cluster_server.url))
    failed_open: list[None] = []
    registry.unavailable_hook = lambda: failed_open.append(None)
    await registry.start()
    try:
        await registry.wait_subscribed()
        client = registry._client
        assert isinstance(client, RedisCluster)
        first = client.get_primaries()[0]  # as if it owned every slot: 2 in 3 claims move
        for slot in list(client.nodes_manager.slots_cache):
            client.nodes_manager.slots_cache[slot] = [first]
        await _reset_stats(cluster_server)
        leases = await asyncio.gather(*(registry.claim(f"moved-{i}") for i in range(300)))
        assert not failed_open
        assert "fencing across processes paused" not in caplog.text
        assert registry.subscribed
        assert await _redirections(cluster_server) >= 20  # they did move
        await asyncio.gather(*(registry.release(lease) for lease in leases))
    finally:
        await registry.close()


def _ports(server: Server) -> list[int]:
    return server.ports if isinstance(server, RedisClusterServer) else [server.port]


async def _reset_stats(server: Server) -> None:
    for port in _ports(server):
        async with Redis(host="127.0.0.1", port=port) as node:
            await node.config_resetstat()


async def _redirections(server: Server) -> int:
    """MOVED and ASK answers given by every node since `_reset_stats`."""
    total = 0
    for port in _ports(server):
        async with Redis(host="127.0.0.1", port=port) as node:
            stats = await node.info("errorstats")
        total += sum(int(stats.get(f"errorstat_{e}", {}).get("count", 0)) for e in ("MOVED", "ASK"))
    return total


@pytest.mark.parametrize("follow", [False, True], ids=["claim", "claim_or_follow"])
async def test_a_claim_whose_reply_was_lost_is_not_run_twice(
    single_redis: RedisServer, caplog: pytest.LogCaptureFixture, follow: bool
) -> None:
    """redis-py sends a command again after a connection error, and the error may come after
    Redis ran the script (a reply lost on the way). A claim run twice made a second attempt
    over its own first one (then waited ACK_WAIT for a fence nobody had to confirm); a claim
    or follow run twice found its own new generation and answered "follow" it."""
    async with Link(single_redis.port) as link:
        registry = RedisRegistry(RegistryConfig(backend="redis", url=link.url))
        await registry.start()

        async def claim(key: str) -> Any:
            if follow:
                return await registry.claim_or_follow(key, "body", True, 5.0, OnRetry.ADAPTIVE)
            return await registry.claim(key)

        try:
            await registry.wait_subscribed()
            await registry.release(await claim("warm"))  # the script is loaded: one EVALSHA
            link.lose_reply_to(b"EVALSHA")
            lease = await claim("k")
            assert link.lost == 1  # the reply was lost, and the call was sent again
            assert isinstance(lease, Lease)
            assert lease.attempt == 1
            assert "did not confirm" not in caplog.text
            await registry.release(lease)
            again = await claim("k")  # the release found its token: the entry went
            assert isinstance(again, Lease) and again.attempt == 1
        finally:
            await registry.close()


async def test_a_burst_of_claims_and_releases_goes_in_a_few_round_trips(
    single_redis: RedisServer,
) -> None:
    """Claims and releases made at once share round trips (`rounds.Batcher`): 300 of each
    need a handful of connections and commands, not one of each per call (then: 64 new
    connections, the pool's size, and 600 commands)."""
    registry = RedisRegistry(RegistryConfig(backend="redis", url=single_redis.url))
    await registry.start()
    try:
        async with redis_client(single_redis) as r:
            before = await r.info("stats")
            leases = await asyncio.gather(*(registry.claim(f"many-{i}") for i in range(300)))
            await asyncio.gather(*(registry.release(lease) for lease in leases))
            after = await r.info("stats")
        opened = after["total_connections_received"] - before["total_connections_received"]
        assert opened <= 2 * ROUNDS, opened
        assert (
            len({lease.token for lease in leases}) == 300
            and min(lease.token for lease in leases) > 0
        )
        async with redis_client(single_redis) as r:
            assert not await r.keys("streamfence:{many-*")  # every entry was released
    finally:
        await registry.close()


async def test_tokens_never_repeat_for_a_key_even_after_redis_loses_its_data(
    redis_server: Server,
) -> None:
    """The counter (one per server; one per slot in a cluster) is floored by Redis's
    clock, so a Redis that comes back empty still hands out larger tokens."""
    registry = RedisRegistry(RegistryConfig(backend="redis", url=redis_server.url))
    await registry.start()
    try:
        keys = [f"t{i}" for i in range(40)]
        first = {k: await registry.claim(k) for k in keys}
        again = {k: await registry.claim(k) for k in keys}
        assert all(again[k].token > first[k].token for k in keys)
        async with redis_client(redis_server) as r:
            await r.flushall()  # every node: as a restart without persistence
            seconds, micros = await r.time()
        after = {k: await registry.claim(k) for k in keys}
        assert all(after[k].token > again[k].token for k in keys)
        # Floored by the clock in microseconds: later than any token of the data it lost.
        assert all(after[k].token >= seconds * 1_000_000 + micros for k in keys)
        assert all(after[k].attempt == 1 for k in keys)  # the entries went with the data
        for lease in [*first.values(), *again.values(), *after.values()]:
            await registry.release(lease)
        if isinstance(redis_server, RedisClusterServer):
            # The turns' entries and counters spread over the masters: no single hot node.
            keys_per_node = []
            for port in redis_server.ports:
                node = Redis(host="127.0.0.1", port=port)
                try:
                    keys_per_node.append(await node.dbsize())
                finally:
                    await node.aclose()
            assert sum(1 for n in keys_per_node if n > 0) == 3, keys_per_node
    finally:
        await registry.close()


async def test_a_newer_claim_heard_before_the_own_reply_still_fences(
    redis_server: Server,
) -> None:
    """The subscription and the claim reply travel on different connections: a newer
    claim of another process can be heard first. It must still fence this one."""
    registry = RedisRegistry(RegistryConfig(backend="redis", url=redis_server.url))
    await registry.start()
    try:
        claim = asyncio.create_task(registry.claim("k"))
        await asyncio.sleep(0)  # the claim is now waiting for Redis
        registry._handshake.heard(2**62, 7, 0, "k")  # as if another process's message came first
        lease = await claim
        assert lease.superseded and lease.newer_attempt == 7
        # ...and a message for an older claim never fences a newer holder.
        current = await registry.claim("j")
        registry._handshake.heard(current.token - 1, 1, 0, "j")
        assert not current.superseded
        await registry.release(lease)
        await registry.release(current)
    finally:
        await registry.close()


async def test_a_fence_is_confirmed_by_message_only_to_a_claim_of_another_process(
    single_redis: RedisServer,
) -> None:
    """Every confirmation reaches every process's subscriber. A claim of this process
    that replaced a lease of this process needs none (it fenced it in its own step), even
    when the old lease has been released before the claim's message is heard, as a
    superseded stream usually has (B5: one confirmation per supersede before). (One server
    only: this is the process's own bookkeeping, and the cluster client may run a claim
    script twice when it retries, a claim whose message then rightly asks for one.)"""
    registry = RedisRegistry(RegistryConfig(backend="redis", url=single_redis.url))
    acked: list[tuple[str, int]] = []
    registry._handshake.ack = acked.append  # type: ignore[method-assign]
    await registry.start()
    try:
        old = await registry.claim("own")
        new = await registry.claim("own")
        assert old.superseded
        await registry.release(old)
        registry._handshake.heard(new.token, new.attempt, old.token, "own")  # its message, late
        assert acked == []
        registry._handshake.heard(new.token + 1, 9, new.token, "own")  # another process's claim
        assert acked == [("own", new.token)]
        await registry.release(new)
        registry._handshake.heard(new.token + 2, 10, new.token, "own")  # ...heard after the release
        assert acked == [("own", new.token)] * 2
        # Another process's claim heard while one of ours for the key waits for its reply:
        # confirmed once ours is answered (and is not the same claim).
        held = await registry.claim("pending")
        ours = asyncio.create_task(registry.claim("pending"))
        await asyncio.sleep(0)  # our claim is now waiting for Redis
        registry._handshake.heard(2**62, 7, held.token, "pending")
        assert acked == [("own", new.token)] * 2
        mine = await ours
        await registry.release(mine)
        await registry.release(held)
        await asyncio.sleep(0)  # the held confirmation goes out in the next loop step
        # (ours is confirmed as fenced too: the message said it was replaced meanwhile)
        assert sorted(acked[2:]) == sorted([("pending", held.token), ("pending", mine.token)])
    finally:
        await registry.close()


async def test_entries_outlive_the_ttl_while_held_and_missed_claims_are_caught_up(
    redis_server: Server,
) -> None:
    ttl = 0.6  # refreshed every ttl/3: a loaded CI machine must not stall the loop for a ttl
    config = RegistryConfig(backend="redis", url=redis_server.url, lease_ttl=ttl)
    registry = RedisRegistry(config)
    await registry.start()
    try:
        await asyncio.wait_for(registry.wait_subscribed(), 5)
        l1 = await registry.claim("k")
        l2 = await registry.claim("k")
        # The same process: fenced at once, in the claimer's task, not via Redis.
        assert l1.superseded and l1.newer_attempt == 2 and not l2.superseded
        assert registry.live_keys() == 1
        entry = RedisRegistry.entry_key("k")
        async with redis_client(redis_server) as r:
            await asyncio.sleep(ttl * 3)  # a time-based property: only refreshes keep it
            assert await r.exists(entry) == 1
            assert 0 < await r.pttl(entry) <= ttl * 1000
            # A newer claim whose message this process never heard (it was not subscribed):
            await r.hset(entry, mapping={"token": str(l2.token + 1), "attempt": "7"})
            await registry._refresh_all()
            assert l2.superseded and l2.newer_attempt == 7
            await registry.release(l1)
            await registry.release(l2)
            assert registry.live_keys() == 0
            assert await r.exists(entry) == 1  # not ours to delete: the newer claim holds it
    finally:
        await registry.close()


async def test_a_retry_goes_ahead_when_the_older_attempts_process_does_not_answer(
    redis_server: Server,
) -> None:
    config = RegistryConfig(backend="redis", url=redis_server.url)
    gone, alive, third = (RedisRegistry(config) for _ in range(3))
    for registry in (gone, alive, third):
        await registry.start()
    try:
        await asyncio.wait_for(
            asyncio.gather(*(r.wait_subscribed() for r in (gone, alive, third))), 5
        )
        old = await gone.claim("k")
        for task in gone._tasks:  # it stops listening, like a process that hangs
            task.cancel()
        started = time.perf_counter()
        new = await alive.claim("k")
        waited = time.perf_counter() - started
        assert new.attempt == 2 and not new.superseded and not old.superseded
        assert ACK_WAIT <= waited < 1.0
        assert (old.key, old.token) not in alive._handshake.acked
        # A process that does answer: the claim returns on its confirmation, not the timeout.
        newer = await third.claim("k")
        assert (new.key, new.token) in third._handshake.acked
        assert new.superseded and newer.attempt == 3
        for registry, lease in ((gone, old), (alive, new), (third, newer)):
            await registry.release(lease)
    finally:
        for registry in (gone, alive, third):
            await registry.close()


async def test_a_claim_cancelled_after_redis_ran_it_leaves_no_entry(
    redis_server: Server,
) -> None:
    registry = RedisRegistry(RegistryConfig(backend="redis", url=redis_server.url))
    await registry.start()
    try:
        async with redis_client(redis_server) as r:
            claim = asyncio.create_task(registry.claim("gone"))
            await asyncio.sleep(0)  # the script is on its way to Redis
            claim.cancel()
            with pytest.raises(asyncio.CancelledError):
                await claim

            async def settled() -> bool:
                # The script ran, and its lease was released in the background: the reply
                # may still be on its way when the counter is already there (seen once in
                # CI on the cluster), so the entry's absence is part of what is waited for.
                ran = await r.exists(registry.keys.counter("gone")) == 1
                gone = await r.exists(RedisRegistry.entry_key("gone")) == 0
                return ran and gone and not registry._background

            await until(settled)
        assert registry.live_keys() == 0
        assert (await registry.claim("gone")).attempt == 1
    finally:
        await registry.close()


async def test_no_event_of_an_older_attempt_starts_after_a_retry_elsewhere_is_accepted(
    upstream: ScriptedUpstream, redis_server: Server, make_proxy: ProxyFactory
) -> None:
    """CONTRACT 2.1 across processes: the retry's claim returns only once the process of
    the attempt it replaces has fenced it. Without that handshake a few percent of these
    rounds delivered the old attempt's next event (the claim message came a little late)."""
    rounds, parallel = 250, 8
    limit = asyncio.Semaphore(parallel)

    async def one(i: int, a: httpx.AsyncClient, b: httpx.AsyncClient) -> None:
        async with limit:
            await _fence_once(a, b, upstream, f"strict-{i}")

    async with (
        redis_proxy(make_proxy, upstream, redis_server) as pa,
        redis_proxy(make_proxy, upstream, redis_server) as pb,
        pa.client() as a,
        pb.client() as b,
    ):
        pairs = [(a, b), (b, a)]
        await asyncio.wait_for(asyncio.gather(*(one(i, *pairs[i % 2]) for i in range(rounds))), 120)


async def test_a_retry_waits_for_a_slow_process_to_fence_its_older_attempt(
    upstream: ScriptedUpstream, redis_server: Server, make_proxy: ProxyFactory
) -> None:
    """The same, made deterministic: the old attempt's process hears every claim 20 ms
    late (a busy event loop). The retry must not be forwarded before that process has
    fenced its attempt; without the handshake every round here delivers a stale event."""
    async with (
        redis_proxy(make_proxy, upstream, redis_server) as pa,
        redis_proxy(make_proxy, upstream, redis_server) as pb,
        pa.client() as a,
        pb.client() as b,
    ):
        registry = pa.runtime.registry
        assert isinstance(registry, RedisRegistry)
        subscriber = registry._subscriber
        hear = subscriber.on_message
        loop = asyncio.get_running_loop()
        delay = ACK_WAIT / 2.5
        subscriber.on_message = lambda m: loop.call_later(delay, hear, m)  # type: ignore[func-returns-value]
        for i in range(5):
            await _fence_once(a, b, upstream, f"slow-{i}")


# -- two proxy processes ---------------------------------------------------------------


async def test_attempt_on_one_process_is_fenced_by_a_retry_on_another(
    upstream: ScriptedUpstream, redis_server: Server, tmp_path: Path
) -> None:
    async with proxy_processes(2, upstream, redis_server, tmp_path) as (pa, pb):
        async with pa.client() as a, pb.client() as b:
            latencies = [await _fence_once(a, b, upstream, f"turn-{i}") for i in range(6)]
            latencies += [await _fence_once(b, a, upstream, f"back-{i}") for i in range(3)]
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.05, latencies  # the bound, median
    assert latencies[-1] < 0.5, latencies  # a loaded CI machine may be slow once


async def test_keys_expire_after_a_process_is_killed(
    upstream: ScriptedUpstream, single_redis: RedisServer, tmp_path: Path
) -> None:
    ttl = 1.0
    env = {"STREAMFENCE_REGISTRY_LEASE_TTL": str(ttl)}
    async with (
        redis_client(single_redis) as r,
        proxy_processes(2, upstream, single_redis, tmp_path, **env) as (pa, pb),
    ):
        await r.config_set("notify-keyspace-events", "Ex")
        expired = r.pubsub()
        await expired.subscribe("__keyevent@0__:expired")
        async with pa.client() as a, pb.client() as b, AsyncExitStack() as stack:
            # Both streams stay open (their readers referenced) until the process dies.
            a_resp, a_events = await _open_gated(stack, a, "crash", "A")
            _, a2_events = await _open_gated(stack, a, "crash-2", "A2")
            entry = "streamfence:{" + a_resp.headers["x-streamfence-turn"]
            [entry_b] = [k async for k in r.scan_iter(match=entry + "*}:turn")]
            # A long stream keeps its entry: the process refreshes it within the TTL.
            await asyncio.sleep(ttl * 2)
            assert await r.exists(entry_b) == 1
            pa.kill()
            # A retry right away: nobody is left to confirm the old attempt's fence, so the
            # claim goes ahead after its short wait instead of hanging.
            started = time.perf_counter()
            early = await b.post(
                CHAT, json=chat_body(stream=False), headers={"X-Turn-Id": "crash-2"}
            )
            assert early.status_code == 200 and early.headers["x-streamfence-attempt"] == "2"
            assert time.perf_counter() - started < ttl
            # Nothing refreshes the other entry now: Redis expires it within about one TTL.
            while True:
                message = await asyncio.wait_for(expired.get_message(timeout=None), ttl * 5)
                if message and message["type"] == "message" and message["data"] == entry_b:
                    break
            retry = await b.post(CHAT, json=chat_body(stream=False), headers={"X-Turn-Id": "crash"})
        await expired.aclose()
    assert retry.status_code == 200
    assert retry.headers["x-streamfence-attempt"] == "1"  # nothing was left behind


def test_registry_config_is_checked() -> None:
    base = {"upstream.url": "http://127.0.0.1:9", "registry.backend": "redis"}
    with pytest.raises(ConfigError) as bad:
        load(env={}, overrides={**base, "registry.url": "http://x", "registry.lease_ttl": 0})
    assert bad.value.problems == [
        "registry.lease_ttl: must be more than 0 (seconds), not 0.0",
        "registry.url: must be a redis://, rediss:// or unix:// URL "
        "(redis+cluster:// or rediss+cluster:// for a Redis Cluster)",
    ]
    ok = load(env={}, overrides={**base, "registry.url": "rediss://:pw@h:6380/2"})
    single = RedisRegistry(ok.registry)
    assert single.channel == "streamfence:2:claims" and not single.keys.cluster
    ok = load(env={}, overrides={**base, "registry.url": "redis+cluster://h:7000"})
    cluster = RedisRegistry(ok.registry)
    assert cluster.channel == "streamfence:0:claims" and cluster.keys.cluster
    assert isinstance(cluster._client, RedisCluster)


def test_workers_need_a_shared_registry() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "--upstream", "http://127.0.0.1:9", "--workers", "2"],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode != 0
    assert "several workers need a shared registry" in proc.stderr
    assert 'backend = "redis"' in proc.stderr


async def test_two_workers_share_the_redis_registry(
    upstream: ScriptedUpstream, single_redis: RedisServer, tmp_path: Path
) -> None:
    """Whichever worker each connection lands on, a retry fences the older attempt."""
    proc = ProxyProcess(upstream.url, single_redis.url, tmp_path / "w.log", "--workers", "2")
    try:
        await proc.ready()
        await _wait_subscribers(single_redis, 2)
        # Separate clients: separate connections, spread by the kernel over the workers.
        for i in range(4):
            async with proc.client() as a, proc.client() as b:
                await _fence_once(a, b, upstream, f"w-{i}")
    finally:
        proc.stop()
    log = proc.log.read_text()
    assert proc.proc.returncode == 0, log
    assert "(2 workers)" in log and "(fail_open when unreachable)" in log


# -- Redis going away --------------------------------------------------------------------


async def _wait_unsubscribed(*proxies: Proxy) -> None:
    for p in proxies:
        registry = p.runtime.registry
        assert isinstance(registry, RedisRegistry)

        async def gone(reg: RedisRegistry = registry) -> bool:
            return not reg.subscribed

        await until(gone)


async def _wait_resubscribed(*proxies: Proxy) -> None:
    for p in proxies:
        registry = p.runtime.registry
        assert isinstance(registry, RedisRegistry)
        await asyncio.wait_for(registry.wait_subscribed(), 5)


async def _wait_ready(*proxies: Proxy) -> None:
    for p in proxies:
        async with p.client() as c:

            async def ready(c: httpx.AsyncClient = c) -> bool:
                return (await c.get("/_streamfence/readyz")).status_code == 200

            await until(ready)


async def test_redis_down_fail_open_forwards_unfenced_then_fencing_resumes(
    upstream: ScriptedUpstream, restartable_redis: Server, make_proxy: ProxyFactory
) -> None:
    async with (
        redis_proxy(make_proxy, upstream, restartable_redis) as pa,
        redis_proxy(make_proxy, upstream, restartable_redis) as pb,
        pa.client() as a,
        pb.client() as b,
        AsyncExitStack() as stack,
    ):
        _, a_events = await _open_gated(stack, a, "down", "before")
        restartable_redis.kill()
        await _wait_unsubscribed(pa, pb)
        # Still serving (unfenced), so still ready: availability first.
        assert (await a.get("/_streamfence/readyz")).status_code == 200
        # Unfenced: the retry is forwarded, and the attempt in flight is not fenced.
        retry = await asyncio.wait_for(
            b.post(CHAT, json=chat_body(stream=False), headers={"X-Turn-Id": "down"}), 5
        )
        assert retry.status_code == 200
        _seen(upstream, "before").release(10)
        rest = await asyncio.wait_for(_collect(a_events), 5)
        assert "".join(e.text for e in rest) == "before1 before2 before3 before4 "
        assert rest[-1].data == "[DONE]"
        metrics = (await b.get("/_streamfence/metrics")).text
        assert "streamfence_registry_unavailable_total 1.0" in metrics
        assert (
            "streamfence_registry_unavailable_total 0.0"
            in (await a.get("/_streamfence/metrics")).text
        )

        await restartable_redis.astart()
        await _wait_resubscribed(pa, pb)
        await _fence_once(a, b, upstream, "after")
        await _fence_once(b, a, upstream, "after-2")
    assert pa.runtime.registry.live_keys() == 0


async def test_redis_down_fail_closed_refuses_keyed_requests_then_fencing_resumes(
    upstream: ScriptedUpstream, restartable_redis: Server, make_proxy: ProxyFactory
) -> None:
    closed = {"registry.on_unavailable": "fail_closed"}
    async with (
        redis_proxy(make_proxy, upstream, restartable_redis, **closed) as pa,
        redis_proxy(make_proxy, upstream, restartable_redis, **closed) as pb,
        pa.client() as a,
        pb.client() as b,
        AsyncExitStack() as stack,
    ):
        _, a_events = await _open_gated(stack, a, "down", "inflight")
        restartable_redis.kill()
        await _wait_unsubscribed(pa, pb)
        assert (await a.get("/_streamfence/readyz")).status_code == 503
        before = len(upstream.seen)
        refused = await asyncio.wait_for(
            b.post(CHAT, json=chat_body(stream=False), headers={"X-Turn-Id": "down"}), 5
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "registry_unavailable"
        assert len(upstream.seen) == before  # never forwarded
        keyless = await b.post(CHAT, json=chat_body(stream=False), headers={"X-Turn-Id": "none"})
        assert keyless.status_code == 200
        # The stream accepted before Redis went away runs to its end; no hang on release.
        _seen(upstream, "inflight").release(10)
        rest = await asyncio.wait_for(_collect(a_events), 5)
        assert rest[-1].data == "[DONE]" and not any(e.is_error for e in rest)

        await restartable_redis.astart()
        await _wait_resubscribed(pa, pb)
        # The first claims after the restart succeed: stale pooled connections are redialled.
        await _fence_once(b, a, upstream, "after")
        await _wait_ready(pa, pb)
    assert pa.runtime.registry.live_keys() == 0 and pb.runtime.registry.live_keys() == 0


async def test_started_while_redis_is_down_it_becomes_ready_when_redis_comes(
    upstream: ScriptedUpstream, restartable_redis: Server, make_proxy: ProxyFactory
) -> None:
    restartable_redis.kill()
    overrides = _redis_overrides(restartable_redis, **{"registry.on_unavailable": "fail_closed"})
    async with make_proxy(upstream.url, **overrides) as proxy, proxy.client() as client:
        assert (await client.get("/_streamfence/readyz")).status_code == 503
        refused = await client.post(CHAT, json=chat_body(stream=False), headers={"X-Turn-Id": "t"})
        assert refused.status_code == 503
        await restartable_redis.astart()
        await _wait_ready(proxy)
        served = await client.post(CHAT, json=chat_body(stream=False), headers={"X-Turn-Id": "t"})
        assert served.status_code == 200 and served.headers["x-streamfence-attempt"] == "1"


async def _collect(stream: AsyncIterator[Event]) -> list[Event]:
    return [e async for e in stream]


# -- stress ----------------------------------------------------------------------------


async def _stress_turn(
    i: int, clients: list[httpx.AsyncClient], upstream: ScriptedUpstream
) -> None:
    """Turn `s{i}`: 1-2 retries alternating between the two proxies, each checked."""
    retries = 1 + i % 2
    name = f"s{i}"
    async with AsyncExitStack() as stack:
        older: list[tuple[str, httpx.Response, AsyncIterator[Event]]] = []
        for j in range(retries + 1):
            client = clients[(i + j) % 2]
            prefix = f"{name}a{j}-"
            if j < retries:
                response, stream = await _open_gated(stack, client, name, prefix)
                older.append((prefix, response, stream))
                if j == 0:
                    continue
                released = _seen(upstream, older[j - 1][0])
                released.release(1)  # sent after this attempt was accepted: must not pass
            else:
                final_task = asyncio.create_task(
                    client.post(
                        CHAT, json=chat_body(tokens=3, prefix=prefix), headers={"X-Turn-Id": name}
                    )
                )
                await asyncio.wait_for(_arrival(upstream, prefix), 5)
                _seen(upstream, older[j - 1][0]).release(1)  # as above
                final = await final_task
                assert final.headers["x-streamfence-attempt"] == str(j + 1)
                assert final.text.endswith("data: [DONE]\n\n")
                assert f"{prefix}2 " in final.text
            # Every attempt before this one: fenced, told so, its upstream closed.
            prev_prefix, prev_response, prev_stream = older[j - 1]
            rest = await asyncio.wait_for(_collect(prev_stream), 5)
            assert len(rest) == 1 and _superseded(rest[0]), (prev_prefix, rest)
            assert prev_response.headers["x-streamfence-attempt"] == str(j)
            seen = _seen(upstream, prev_prefix)
            await asyncio.wait_for(seen.closed.wait(), 5)
            assert seen.events_sent <= 2 and not seen.finished


async def _stress(clients: list[httpx.AsyncClient], upstream: ScriptedUpstream, turns: int) -> None:
    limit = asyncio.Semaphore(20)

    async def turn(i: int) -> None:
        async with limit:
            await _stress_turn(i, clients, upstream)

    await asyncio.wait_for(asyncio.gather(*(turn(i) for i in range(turns))), 120)
    supersedes = sum(1 + i % 2 for i in range(turns))
    assert len(upstream.seen) == turns + supersedes


async def _no_entries_left(server: Server) -> None:
    async with redis_client(server) as r:

        async def empty() -> bool:
            return [k async for k in r.scan_iter(match="streamfence:{*}:turn")] == []

        await until(empty)  # releases run just after each response's last byte


@pytest.mark.stress
async def test_stress_supersedes_spread_over_two_proxies(
    upstream: ScriptedUpstream, redis_server: Server, make_proxy: ProxyFactory
) -> None:
    """200 turns, each superseded once or twice, attempts alternating between two apps
    with registries of their own (one event loop: their insides can be checked)."""
    limits = httpx.Limits(max_connections=100)
    async with (
        redis_proxy(make_proxy, upstream, redis_server) as pa,
        redis_proxy(make_proxy, upstream, redis_server) as pb,
        pa.client(limits=limits) as a,
        pb.client(limits=limits) as b,
    ):
        await _stress([a, b], upstream, turns=200)

        async def drained() -> bool:
            return pa.runtime.registry.live_keys() == 0 and pb.runtime.registry.live_keys() == 0

        await until(drained)
        await _no_entries_left(redis_server)


@pytest.mark.stress
async def test_stress_supersedes_spread_over_two_processes(
    upstream: ScriptedUpstream, single_redis: RedisServer, tmp_path: Path
) -> None:
    """The same across two `python -m proxy` processes."""
    async with proxy_processes(2, upstream, single_redis, tmp_path) as (pa, pb):
        async with pa.client() as a, pb.client() as b:
            await _stress([a, b], upstream, turns=120)
        await _no_entries_left(single_redis)


async def test_a_registry_closed_at_any_moment_of_its_start_closes(redis_server: Server) -> None:
    # CI hung once in close(): its subscriber was cancelled while redis-py connected, under
    # asyncio.wait_for, which on Python 3.11 loses a cancellation that lands as its inner
    # send completes (gh-86296); the subscriber then waited for ever, and close with it. With
    # close cancelling only once, this loop hung within 20-80 rounds under a CPU hog.
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    for round_ in range(100):
        registry = RedisRegistry(RegistryConfig(backend="redis", url=redis_server.url))
        await registry.start()
        await asyncio.sleep(rng.random() * 0.03)  # anywhere in connecting and subscribing
        if rng.random() < 0.5:
            await registry.release(await registry.claim(f"close-{round_}"))
        await asyncio.wait_for(registry.close(), 8)


async def test_a_generation_log_lives_its_whole_ttl_before_its_writer_writes(
    redis_server: Server,
) -> None:
    # The claim creates the log, its meta and (with a follower) its readers; the writer's
    # first write comes only when the upstream answers, which a reasoning model may take
    # far longer than a moment to do. Until then each key must carry the log's own TTL, or a
    # twin on another process finds no log to follow and asks upstream a second time.
    async with registries(redis_server) as (a, b), redis_client(redis_server) as r:
        store = a.generation_log().store
        assert store.ttl_ms > 2 * store.maxlen  # the keys' TTL is not the length cap's value
        lease = await a.claim_or_follow("slow", "h", True, 5.0, OnRetry.ADAPTIVE)
        assert isinstance(lease, Lease)
        log = f"{store.prefix('slow')}{lease.token}"
        # b follows: it is registered as a reader of the log, which makes the readers key.
        follow = await b.claim_or_follow("slow", "h", True, 5.0, OnRetry.ADAPTIVE)
        assert isinstance(follow, Follow)
        for key in (log, f"{log}:meta", f"{log}:readers"):
            assert store.ttl_ms - 5000 < await r.pttl(key) <= store.ttl_ms, key
