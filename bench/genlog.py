"""Measure the generation log (proxy/registry/genlog/log.py) against the alternative it was
chosen over, on a private redis-server (or a three-master cluster with --cluster).

    python -m bench.genlog [--batches 1000] [--every 0.002] [--cluster]

- live: a writer appends one event per batch every `--every` seconds; a follower on a
  connection of its own (as another process would) reads it live. Latency is from the
  append call to the follower holding the batch (time.perf_counter(), one process).
  The same with pub/sub plus a list (one script per batch: RPUSH + PUBLISH; the follower
  subscribed), the design a Stream replaces.
- catch-up: a follower that comes after 200 batches: time to the first batch, and to all.
- ops: Redis commands per relayed event (INFO commandstats before and after), writer and
  follower, at one event per upstream read (the worst case: batches coalesce under load).
- memory: used_memory per in-flight generation of 100 events of 200 bytes.

All numbers come from one shared machine: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from proxy.registry.genlog.log import GenerationLog
from proxy.registry.redisio import Client, connect
from tests.redis_server import RedisServer, running_cluster

PUBSUB_APPEND = """
redis.call('RPUSH', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], 30000)
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"""


@contextmanager
def server(cluster: bool) -> Iterator[Any]:
    if cluster:
        with running_cluster() as c:
            yield c
    else:
        with tempfile.TemporaryDirectory() as d:
            s = RedisServer(d)
            s.start()
            try:
                yield s
            finally:
                s.stop()


def ports(srv: Any) -> list[int]:
    return list(srv.ports) if hasattr(srv, "ports") else [srv.port]


async def commandstats(srv: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for port in ports(srv):
        node = Redis(host="127.0.0.1", port=port)
        try:
            stats = await node.info("commandstats")
        finally:
            await node.aclose()
        for name, value in stats.items():
            total[name] = total.get(name, 0) + int(value["calls"])
    return total


async def used_memory(srv: Any) -> int:
    used = 0
    for port in ports(srv):
        node = Redis(host="127.0.0.1", port=port)
        try:
            used += int((await node.info("memory"))["used_memory"])
        finally:
            await node.aclose()
    return used


@asynccontextmanager
async def clients(url: str) -> AsyncIterator[tuple[Client, Client]]:
    a, b = connect(url), connect(url)
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))] * 1000


async def live_streams(url: str, srv: Any, batches: int, every: float) -> dict[str, Any]:
    async with clients(url) as (ca, cb):
        wlog, rlog = GenerationLog(ca), GenerationLog(cb)
        writer = await wlog.open("bench", 1, body_hash="h", streaming=True)
        writer.started(200, [("content-type", "text/event-stream")])
        await writer.flushed()
        reader = await rlog.follow("bench", 1)
        sent: dict[int, float] = {}
        latencies: list[float] = []

        async def read() -> None:
            got = 0
            async for batch in reader:
                now = time.perf_counter()
                for i in range(len(batch.events)):
                    latencies.append(now - sent[batch.first + i])
                got += len(batch.events)
                if got >= batches:
                    return

        before = await commandstats(srv)
        task = asyncio.create_task(read())
        for i in range(batches):
            sent[i] = time.perf_counter()
            writer.append([b"data: " + b"x" * 190 + b"\n\n"])
            await asyncio.sleep(every)
        await task
        after = await commandstats(srv)
        await writer.end("completed")
        await reader.aclose()
    ops = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    ops.pop("cmdstat_info", None)
    return {"p50": pct(latencies, 0.5), "p99": pct(latencies, 0.99), "ops": ops}


async def live_pubsub(url: str, batches: int, every: float) -> dict[str, Any]:
    async with clients(url) as (ca, cb):
        script = ca.register_script(PUBSUB_APPEND)
        if isinstance(cb, RedisCluster):
            await cb.initialize()  # its pubsub needs the slot map
        pubsub = cb.pubsub()
        await pubsub.subscribe("bench:ch")
        await pubsub.get_message(timeout=1)
        latencies: list[float] = []
        sent: list[float] = []

        async def read() -> None:
            while len(latencies) < batches:
                m = await pubsub.get_message(timeout=1)
                if m and m["type"] == "message":
                    latencies.append(time.perf_counter() - sent[len(latencies)])

        task = asyncio.create_task(read())
        for _ in range(batches):
            sent.append(time.perf_counter())
            await script(keys=["bench:{x}:list"], args=["bench:ch", b"x" * 200])
            await asyncio.sleep(every)
        await task
        await pubsub.aclose()  # type: ignore[no-untyped-call]
    return {"p50": pct(latencies, 0.5), "p99": pct(latencies, 0.99)}


async def catch_up(url: str) -> dict[str, float]:
    async with clients(url) as (ca, cb):
        writer = await GenerationLog(ca).open("late", 1, body_hash="h", streaming=True)
        for _ in range(200):
            writer.append([b"data: " + b"x" * 190 + b"\n\n"])
            await writer.flushed()
        rlog = GenerationLog(cb)
        await rlog.readers("late", 1)  # a warm connection, as a running process has
        started = time.perf_counter()
        reader = await rlog.follow("late", 1)
        first = await anext(reader)
        t_first = time.perf_counter() - started
        got = len(first.events)
        while got < 200:
            got += len((await anext(reader)).events)
        t_all = time.perf_counter() - started
        await writer.end("completed")
        await reader.aclose()
    return {"first_ms": t_first * 1000, "all_ms": t_all * 1000}


async def memory(url: str, srv: Any, generations: int = 200) -> dict[str, float]:
    async with clients(url) as (ca, _):
        log = GenerationLog(ca)
        base = await used_memory(srv)
        writers = []
        for g in range(generations):
            w = await log.open(f"mem{g}", g + 1, body_hash="h" * 64, streaming=True)
            w.started(200, [("content-type", "text/event-stream"), ("x-request-id", "r" * 32)])
            for _ in range(100):
                w.append([b"data: " + b"x" * 192 + b"\n\n"])
                await w.flushed()
            writers.append(w)
        used = await used_memory(srv) - base
        for w in writers:
            await w.end("completed")
    return {"per_generation_kib": used / generations / 1024, "payload_kib": 100 * 200 / 1024}


async def main(args: argparse.Namespace) -> None:
    with server(args.cluster) as srv:
        url = srv.url
        streams = await live_streams(url, srv, args.batches, args.every)
        pubsub = await live_pubsub(url, args.batches, args.every)
        late = await catch_up(url)
        mem = await memory(url, srv)
    kind = "three-master cluster" if args.cluster else "one redis-server"
    print(f"generation log on {kind}, {args.batches} batches of one event, every {args.every}s")
    print(
        f"  live, Streams (XREAD BLOCK):  p50 {streams['p50']:.2f} ms  p99 {streams['p99']:.2f} ms"
    )
    print(f"  live, pub/sub + list:         p50 {pubsub['p50']:.2f} ms  p99 {pubsub['p99']:.2f} ms")
    print(
        f"  catch-up of 200 batches: first {late['first_ms']:.2f} ms, all {late['all_ms']:.2f} ms"
    )
    ops = streams["ops"]
    writes = sum(v for k, v in ops.items() if k.startswith("cmdstat_evalsha"))
    reads = ops.get("cmdstat_xread", 0)
    per = args.batches
    print(
        f"  Redis commands per relayed event: writer {writes / per:.2f} (scripts, heartbeats "
        f"included), follower {reads / per:.2f} XREAD (+ one check every 0.5 s); {ops}"
    )
    print(
        f"  memory per in-flight generation (100 events of 200 B = {mem['payload_kib']:.1f} KiB "
        f"payload): {mem['per_generation_kib']:.1f} KiB"
    )


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--every", type=float, default=0.002)
    p.add_argument("--cluster", action="store_true")
    asyncio.run(main(p.parse_args()))


if __name__ == "__main__":
    cli()
