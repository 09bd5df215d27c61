"""The generation log against a real redis-server and a real three-master cluster: two
registries (two clients, as two processes) write and follow one generation; a writer in a
subprocess is killed; Redis is restarted and capped mid-stream.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from proxy.config.schema import RegistryConfig
from proxy.errors import GenerationLost
from proxy.registry.genlog.log import (
    DEAD_AFTER,
    DETECT_WITHIN,
    HEARTBEAT,
    READER_TTL,
    Batch,
    GenerationLog,
    LogReader,
    LogWriter,
)
from proxy.registry.redis import RedisRegistry
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

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

ROOT = Path(__file__).resolve().parents[2]
HEADERS = [("content-type", "text/event-stream"), ("x-upstream", "a"), ("x-upstream", "b")]


def ev(i: int) -> bytes:
    return f"data: {i}\n\n".encode()


async def _take(reader: LogReader, events: int, within: float = 5.0) -> list[Batch]:
    """Batches until `events` events have come."""
    got: list[Batch] = []
    while sum(len(b.events) for b in got) < events:
        got.append(await asyncio.wait_for(anext(reader), within))
    return got


def _flat(batches: list[Batch]) -> list[tuple[int, bytes]]:
    return [(b.first + i, e) for b in batches for i, e in enumerate(b.events)]


async def _readers(writer: LogWriter, n: int) -> None:
    """Until the writer counts n readers: it recounts at least every HEARTBEAT."""

    async def counted() -> bool:
        return writer.readers == n

    await until(counted, within=HEARTBEAT * 5)


async def test_a_follower_elsewhere_catches_up_then_follows_live_in_order(
    redis_server: Server,
) -> None:
    async with registries(redis_server) as (a, b):
        lease = await a.claim("turn")
        writer = await a.generation_log().open("turn", lease.token, body_hash="h1", streaming=True)
        writer.started(200, HEADERS)
        writer.append([ev(0), ev(1)])
        writer.append([ev(2)])  # may coalesce with the read before: still one round trip
        await writer.flushed()

        current = await b.generation_log().current("turn")
        assert current is not None and current.token == lease.token and current.attempt == 1
        assert current.meta is not None
        assert current.meta.body_hash == "h1" and current.meta.streaming
        assert current.meta.start == (200, HEADERS) and current.meta.ended is None
        assert 0 <= current.meta.since_activity < 2 and current.meta.writer_alive

        log_b = b.generation_log()
        async with (
            await log_b.follow("turn", lease.token) as reader,
            await log_b.follow("turn", lease.token, after=1) as resumed,
        ):
            assert await reader.wait_start() == (200, HEADERS)
            assert _flat(await _take(reader, 3)) == [(0, ev(0)), (1, ev(1)), (2, ev(2))]
            assert _flat(await _take(resumed, 1)) == [(2, ev(2))]
            # Live: each batch reaches both followers, in order, once.
            for i in range(3, 40, 3):
                writer.append([ev(i), ev(i + 1), ev(i + 2)])
            live = [(i, ev(i)) for i in range(3, 42)]
            assert _flat(await _take(reader, 39)) == live
            assert _flat(await _take(resumed, 39)) == live
            await _readers(writer, 2)  # both registered, counted by the writer
            await writer.end("completed")
            assert [batch async for batch in reader] == []
            assert reader.outcome == "completed"
        await writer.flushed()
        assert await log_b.readers("turn", lease.token) == 0  # both unregistered
        # A follower that comes after the end reads it all, and the end.
        async with await log_b.follow("turn", lease.token) as late:
            everything = _flat([batch async for batch in late])
        assert everything == [(i, ev(i)) for i in range(42)]
        assert late.outcome == "completed"
        await a.release(lease)


async def test_the_writer_counts_readers_of_every_process_and_forgets_crashed_ones(
    redis_server: Server,
) -> None:
    async with registries(redis_server, 3) as (a, b, c):
        writer = await a.generation_log().open("k", 7, body_hash="h", streaming=True)
        rb = await b.generation_log().follow("k", 7)
        rc = await c.generation_log().follow("k", 7)
        writer.append([ev(0)])
        await _readers(writer, 2)
        await rb.aclose()
        await _readers(writer, 1)
        # A reader whose process dies stops refreshing: it is not counted after its TTL.
        assert rc._keepalive is not None
        rc._keepalive.cancel()
        started = time.monotonic()

        async def forgotten() -> bool:
            return writer.readers == 0  # the writer's heartbeats re-count every second

        await until(forgotten, within=READER_TTL + 8)  # heartbeats run late on a busy machine
        assert time.monotonic() - started >= READER_TTL - 1.0
        await writer.end("completed")


async def test_a_silent_writer_stays_alive_and_a_killed_one_is_detected_within_the_bound(
    redis_server: Server, tmp_path: Path
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "tests.genlog_writer", redis_server.url, "dies", "11"],
        cwd=ROOT,
        env=clean,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line.strip() == b"ready"
        async with registries(redis_server, 1) as (b,):
            reader = await b.generation_log().follow("dies", 11)
            assert _flat(await _take(reader, 1)) == [(0, ev(0))]
            # Nothing is sent for longer than the bound: heartbeats keep the writer alive.
            pending = asyncio.ensure_future(anext(reader))
            done, _ = await asyncio.wait([pending], timeout=DETECT_WITHIN + 1)
            assert not done
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            killed = time.monotonic()
            with pytest.raises(GenerationLost) as lost:
                await asyncio.wait_for(pending, DETECT_WITHIN + 2)
            waited = time.monotonic() - killed
            assert lost.value.reason == "writer_gone"
            assert "stopped sending" in lost.value.message
            assert waited <= DETECT_WITHIN + 0.5, waited  # the documented bound (+ slack)
            await reader.aclose()
            # A follower that comes now is told at once.
            started = time.monotonic()
            with pytest.raises(GenerationLost):
                await b.generation_log().follow("dies", 11)
            assert time.monotonic() - started < 1.0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_maxlen_and_expiry_bound_the_log(redis_server: Server) -> None:
    async with registries(redis_server, 1) as (a,), redis_client(redis_server) as r:
        log = GenerationLog(a._client, maxlen=10, ttl=5.0, linger=2.0)
        stream, meta, _ = log.keys("long", 3)
        writer = await log.open("long", 3, body_hash="h", streaming=True)
        for i in range(600):
            writer.append([ev(i)])
            await writer.flushed()  # one entry per batch: nothing coalesces
        # Approximate trimming drops whole nodes of 100 entries: far below 600 either way.
        assert 10 <= await r.xlen(stream) <= 210
        assert 0 < await r.pttl(stream) <= 5000 and 0 < await r.pttl(meta) <= 5000
        with pytest.raises(GenerationLost) as trimmed:
            await _take(await log.follow("long", 3), 1)
        assert trimmed.value.reason == "trimmed"
        async with await log.follow("long", 3, after=598) as tail:
            assert _flat(await _take(tail, 1)) == [(599, ev(599))]
        await writer.end("failed")
        assert 0 < await r.pttl(stream) <= 2000

        async def expired() -> bool:
            return await r.exists(stream, meta) == 0

        await until(expired, within=4)
        with pytest.raises(GenerationLost) as gone:
            await log.follow("long", 3)
        assert gone.value.reason == "not_found"


async def test_redis_restarted_mid_stream_readers_get_an_error_writers_carry_on(
    restartable_redis: Server,
) -> None:
    async with registries(restartable_redis) as (a, b):
        writer = await a.generation_log().open("r", 5, body_hash="h", streaming=True)
        writer.append([ev(0)])
        reader = await b.generation_log().follow("r", 5)
        assert _flat(await _take(reader, 1)) == [(0, ev(0))]
        pending = asyncio.ensure_future(anext(reader))
        restartable_redis.kill()
        with pytest.raises(GenerationLost) as lost:
            await asyncio.wait_for(pending, DETECT_WITHIN + 2)
        assert lost.value.reason in ("unavailable", "lost")
        # The writer never raises: its appends only queue; it gives up publishing.
        writer.append([ev(1)])
        await asyncio.wait_for(writer.flushed(), 5)
        await restartable_redis.astart()
        writer.append([ev(2)])
        await asyncio.wait_for(writer.flushed(), 5)
        assert writer.broken
        await asyncio.wait_for(writer.end("completed"), 5)
        await reader.aclose()


async def test_a_log_redis_lost_is_reported_as_lost_to_readers(redis_server: Server) -> None:
    async with registries(redis_server) as (a, b), redis_client(redis_server) as r:
        log = a.generation_log()
        abandoned: list[str] = []
        log.abandoned_hook = abandoned.append
        writer = await log.open("evicted", 9, body_hash="h", streaming=True)
        writer.append([ev(0)])
        await writer.flushed()
        reader = await b.generation_log().follow("evicted", 9)
        assert _flat(await _take(reader, 1)) == [(0, ev(0))]
        stream, meta, _ = log.keys("evicted", 9)
        await r.delete(meta)  # as an eviction policy or a restart would
        writer.append([ev(1)])
        await writer.flushed()
        assert writer.broken and abandoned == ["lost"]
        with pytest.raises(GenerationLost) as lost:
            await _take(reader, 1)
        assert lost.value.reason == "lost"
        await reader.aclose()


async def _config_set(server: Server, **settings: str) -> None:
    ports = server.ports if isinstance(server, RedisClusterServer) else [server.port]
    for port in ports:
        node = Redis(host="127.0.0.1", port=port)
        try:
            for name, value in settings.items():
                await node.config_set(name.replace("_", "-"), value)
        finally:
            await node.aclose()


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
async def test_maxmemory_nothing_hangs(redis_server: Server, policy: str) -> None:
    """Redis capped: whether it evicts the log or refuses writes, the writer carries on
    (broken: local only) and a follower gets an error, within the bound."""
    async with registries(redis_server) as (a, b):
        log = a.generation_log()
        writer = await log.open("big", 1, body_hash="h", streaming=True)
        writer.append([ev(0)])
        await writer.flushed()
        reader = await b.generation_log().follow("big", 1)
        assert _flat(await _take(reader, 1)) == [(0, ev(0))]
        await _config_set(redis_server, maxmemory="3mb", maxmemory_policy=policy)
        try:
            chunk = b"data: " + b"x" * 65536 + b"\n\n"
            deadline = time.monotonic() + 10
            while not writer.broken:
                assert time.monotonic() < deadline, "the writer never noticed the cap"
                writer.append([chunk])
                await writer.flushed()
                # Eviction may take a shared key too (the registry's own, the counter):
                # the follower keeps reading meanwhile, and must end in an error, not hang.
            with pytest.raises(GenerationLost):
                while True:
                    await asyncio.wait_for(anext(reader), DETECT_WITHIN + 2)
        finally:
            await _config_set(redis_server, maxmemory="0", maxmemory_policy="noeviction")
            await reader.aclose()
        await asyncio.wait_for(writer.end("completed"), 5)


# side cut off from Redis -> (how long a short cut lasts, what a cut for good is reported as).
# Short: over one call's socket timeout (1.5 s for a blocking read, 1 s for a write), under
# the bound (DETECT_WITHIN for a reader, DEAD_AFTER for a writer).
CUTS = {"reader": (2.0, "unavailable"), "writer": (1.3, "writer_gone")}


@pytest.mark.parametrize("side", CUTS)
async def test_a_short_silence_of_redis_is_ridden_out_and_a_long_one_reported(
    single_redis: RedisServer, side: str
) -> None:
    """A reader, or the writer, cut off from Redis for less than its bound (one of its calls
    times out) carries on, nothing lost or doubled; cut off for good, the reader gets
    GenerationLost within DETECT_WITHIN, never a hang."""
    short, reported = CUTS[side]
    async with registries(single_redis, 1) as (direct,), Link(single_redis.port) as link:
        linked = RedisRegistry(RegistryConfig(backend="redis", url=link.url))
        await linked.start()
        w, r = (direct, linked) if side == "reader" else (linked, direct)
        try:
            writer = await w.generation_log().open("quiet", 4, body_hash="h", streaming=True)
            writer.append([ev(0)])
            reader = await r.generation_log().follow("quiet", 4)
            assert _flat(await _take(reader, 1)) == [(0, ev(0))]
            pending = asyncio.ensure_future(_take(reader, 2, within=DETECT_WITHIN + 5))
            link.cut()
            writer.append([ev(1)])
            await asyncio.sleep(short)  # the partition's length
            link.heal()
            writer.append([ev(2)])
            assert _flat(await pending) == [(1, ev(1)), (2, ev(2))]
            assert not writer.broken
            link.cut()
            writer.append([ev(3)])
            cut = time.monotonic()
            with pytest.raises(GenerationLost) as lost:
                await asyncio.wait_for(
                    _take(reader, 1, within=DETECT_WITHIN + 3), DETECT_WITHIN + 3
                )
            assert lost.value.reason == reported
            assert time.monotonic() - cut <= DETECT_WITHIN + 2.0
            link.heal()
            await reader.aclose()
            await writer.end("completed")
        finally:
            await linked.close()


async def test_hundreds_of_busy_streams_over_a_slow_link_neither_fail_claims_nor_give_up(
    single_redis: RedisServer,
) -> None:
    """Over a link with 0.3 s round trips, 400 streams each append every 20 ms while 50
    turns are claimed. A writer that needed a pooled connection per write took 1.8 s to get
    one (400 writers, 64 connections, 0.3 s each): past the pool's wait, then past DEAD_AFTER
    it gave up its log; and claims, in the same pool, failed open. One publisher round carries
    every writer's write on one connection, and claims have a pool of their own."""
    streams, claims = 400, 50
    async with registries(single_redis, 1) as (direct,), Link(single_redis.port, 0.15) as link:
        slow = RedisRegistry(RegistryConfig(backend="redis", url=link.url))
        failed_open: list[None] = []  # one per claim forwarded unfenced
        slow.unavailable_hook = lambda: failed_open.append(None)
        await slow.start()
        try:
            log = slow.generation_log()
            writers = [
                log.writer(f"busy-{i}", 1, body_hash="h", streaming=True) for i in range(streams)
            ]
            sent = 0

            async def append_for(seconds: float) -> None:
                nonlocal sent
                until = time.monotonic() + seconds
                while time.monotonic() < until:
                    for writer in writers:
                        writer.append([ev(sent)])
                    sent += 1
                    await asyncio.sleep(0.02)  # the upstream's pace

            appending = asyncio.ensure_future(append_for(DEAD_AFTER + 2))
            await asyncio.sleep(0.5)  # the writers are busy
            leases = await asyncio.gather(*(slow.claim(f"claimed-{i}") for i in range(claims)))
            await appending
            assert not failed_open
            assert all(lease.token > 0 for lease in leases)
            await asyncio.wait_for(asyncio.gather(*(w.flushed() for w in writers)), 10)
            assert not any(w.broken for w in writers)
            # Published whole and in order (read without the slow link).
            async with await direct.generation_log().follow("busy-7", 1) as reader:
                got = _flat(await _take(reader, sent))
            assert got == [(i, ev(i)) for i in range(sent)]
            await asyncio.gather(*(w.end("completed") for w in writers))
        finally:
            await slow.close()
