"""Measure the Redis registry: cross-process fence latency and the time to first byte it adds.

    python -m bench.redis_fence [--rounds 100] [--ttfb 300]

Starts a private redis-server (loopback, no persistence), a scripted upstream in this
process (tests/scripted.py) and streamfence as real subprocesses (`python -m proxy`):

- fence: two proxies sharing Redis. An attempt streams through one and waits upstream; a
  retry of its turn is sent through the other. Latency is from just before the retry is
  sent to the moment the upstream sees the old attempt's connection close, both read
  with time.perf_counter() in this process. Directions alternate. For reference, the
  same measurement with both attempts on one in-memory proxy.
- ttfb: the same streaming request (a fresh turn key each time, so every request claims)
  sent in turn straight to the upstream, through an in-memory proxy and through a Redis
  proxy; time to the first SSE event's bytes at the client. The added latency of Redis is
  the difference of the proxies' medians.

All numbers come from one shared machine: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from redis.asyncio import Redis

from tests.redis_server import RedisClusterServer, Server, running_cluster, running_redis
from tests.scripted import ScriptedUpstream, free_port

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"


@asynccontextmanager
async def serve_upstream(app: ScriptedUpstream) -> AsyncIterator[str]:
    """Like tests.scripted.serve, but the listening socket says IPPROTO_TCP, so asyncio
    sets TCP_NODELAY on its connections: otherwise the first body write after the
    headers waits for a delayed ACK (~40 ms) and hides everything measured here."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def added_ttfb(client: httpx.AsyncClient) -> tuple[float, float]:
    """The proxy's own streamfence_added_ttfb_seconds histogram: (sum, count)."""
    text = (await client.get("/_streamfence/metrics")).text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("streamfence_added_ttfb_seconds_")
    }
    return values["streamfence_added_ttfb_seconds_sum"], values[
        "streamfence_added_ttfb_seconds_count"
    ]


def _spawn(args: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@asynccontextmanager
async def proxy_process(upstream: str, *extra: str) -> AsyncIterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
    args = [sys.executable, "-m", "proxy", "--upstream", upstream, "--port", str(port)]
    args += ["--log-level", "warning", "--log-format", "text", *extra]
    with tempfile.TemporaryFile() as log:
        proc = _spawn(args, env, log)
        try:
            async with httpx.AsyncClient(timeout=1) as client:
                deadline = time.monotonic() + 30
                while True:
                    if proc.poll() is not None:
                        log.seek(0)
                        raise RuntimeError(log.read().decode(errors="replace"))
                    try:
                        if (await client.get(url + "/_streamfence/readyz")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("streamfence did not become ready")
                    await asyncio.sleep(0.05)
            yield url
        finally:
            proc.terminate()
            proc.wait(15)


async def wait_subscribers(redis: Server, n: int) -> None:
    # readyz is 200 in fail_open mode before the subscription is live; count listeners
    # (in a cluster, each process subscribes on every master).
    ports = redis.ports if isinstance(redis, RedisClusterServer) else [redis.port]
    for port in ports:
        client = Redis(host="127.0.0.1", port=port)
        try:
            deadline = time.monotonic() + 30
            while (await client.pubsub_numsub("streamfence:0:claims"))[0][1] < n:
                if time.monotonic() > deadline:
                    raise RuntimeError("the proxies did not subscribe")
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()


def body(prefix: str, **script: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": prefix}],
        "stream": True,
        "script": {"prefix": prefix, **script},
    }


async def fence_round(
    upstream: ScriptedUpstream, a: httpx.AsyncClient, b: httpx.AsyncClient, turn: str
) -> tuple[float, float]:
    """(fence latency, the retry's whole response time)."""
    headers = {"X-Turn-Id": turn}
    async with AsyncExitStack() as stack:
        old = await stack.enter_async_context(
            a.stream("POST", CHAT, json=body(f"{turn}-A", gated=True, tokens=5), headers=headers)
        )
        chunks = old.aiter_raw()
        await anext(chunks)  # the first event: the old attempt is streaming
        seen = next(s for s in reversed(upstream.seen) if s.script.prefix == f"{turn}-A")
        sent = time.perf_counter()
        retry = asyncio.create_task(
            b.post(CHAT, json=body(f"{turn}-B", stream=False), headers=headers)
        )
        await asyncio.wait_for(seen.closed.wait(), 10)
        assert seen.closed_at is not None
        latency = seen.closed_at - sent
        tail = b"".join([c async for c in chunks])
        assert b"stream_superseded" in tail, tail
        assert (await retry).status_code == 200
        answered = time.perf_counter() - sent
    return latency, answered


async def follow_round(
    upstream: ScriptedUpstream, a: httpx.AsyncClient, b: httpx.AsyncClient, turn: str
) -> tuple[float, float]:
    """An attempt streams through `a`; an identical one through `b` follows it. Returns
    (the follower's first event, from its request sent; a live event's arrival at the
    follower, from its release upstream)."""
    headers = {"X-Turn-Id": turn}
    request = body(turn, gated=True, tokens=4)
    async with AsyncExitStack() as stack:
        origin = await stack.enter_async_context(
            a.stream("POST", CHAT, json=request, headers=headers)
        )
        a_chunks = origin.aiter_raw()
        await anext(a_chunks)
        seen = next(s for s in reversed(upstream.seen) if s.script.prefix == turn)
        sent = time.perf_counter()
        follower = await stack.enter_async_context(
            b.stream("POST", CHAT, json=request, headers=headers)
        )
        assert follower.headers["x-streamfence-source"] == "followed", follower.headers
        b_chunks = follower.aiter_raw()
        await anext(b_chunks)
        first = time.perf_counter() - sent
        released = time.perf_counter()
        seen.release(1)
        await anext(b_chunks)
        live = time.perf_counter() - released
        seen.release(10)
        tails = [c async for c in a_chunks], [c async for c in b_chunks]
        assert all(b"[DONE]" in b"".join(t) for t in tails)
    return first, live


async def ttfb_once(client: httpx.AsyncClient, turn: str) -> float:
    start = first = time.perf_counter()
    headers = {"X-Turn-Id": turn}
    async with client.stream("POST", CHAT, json=body(turn, tokens=1), headers=headers) as r:
        got_first = False
        async for chunk in r.aiter_raw():
            if chunk and not got_first:
                first, got_first = time.perf_counter(), True
    return first - start


def describe(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    p90 = ms[min(len(ms) - 1, int(len(ms) * 0.9))]
    return (
        f"median {statistics.median(ms):.2f} ms, p90 {p90:.2f} ms, worst {ms[-1]:.2f} ms "
        f"(n={len(ms)})"
    )


async def main(rounds: int, ttfb_rounds: int, cluster: bool = False) -> None:
    upstream = ScriptedUpstream()
    with running_cluster() if cluster else running_redis() as redis:
        async with serve_upstream(upstream) as up_url, AsyncExitStack() as stack:
            upstream.url = up_url
            ra = await stack.enter_async_context(proxy_process(up_url, "--registry-url", redis.url))
            rb = await stack.enter_async_context(proxy_process(up_url, "--registry-url", redis.url))
            mem = await stack.enter_async_context(proxy_process(up_url))
            await wait_subscribers(redis, 2)
            clients = {
                name: await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=10))
                for name, url in (("a", ra), ("b", rb), ("mem", mem), ("direct", up_url))
            }
            a, b, m = clients["a"], clients["b"], clients["mem"]
            for i in range(5):  # warm up connections and code paths
                await fence_round(upstream, a, b, f"warm-{i}")
                await fence_round(upstream, m, m, f"warm-m-{i}")

            cross = []
            for i in range(rounds):
                x, y = (a, b) if i % 2 == 0 else (b, a)
                cross.append(await fence_round(upstream, x, y, f"cross-{i}"))
            local = [await fence_round(upstream, m, m, f"local-{i}") for i in range(rounds)]
            print(f"fence, two processes sharing Redis: {describe([c[0] for c in cross])}")
            print(f"fence, one process, memory registry: {describe([c[0] for c in local])}")
            # A retry whose older attempt lives in another process waits for its fence to
            # be confirmed (the handshake); compare the retry's own response time.
            print(f"retry answered, other process (redis): {describe([c[1] for c in cross])}")
            print(f"retry answered, same process (memory): {describe([c[1] for c in local])}")

            before_up = len(upstream.seen)
            remote = [await follow_round(upstream, a, b, f"follow-{i}") for i in range(rounds)]
            local = [await follow_round(upstream, a, a, f"follow-l-{i}") for i in range(rounds)]
            assert len(upstream.seen) - before_up == 2 * rounds  # every follower saved one
            print(f"follower's first event, other process: {describe([r[0] for r in remote])}")
            print(f"follower's first event, same process:  {describe([r[0] for r in local])}")
            print(f"live event at the follower, other process: {describe([r[1] for r in remote])}")
            print(f"live event at the follower, same process:  {describe([r[1] for r in local])}")

            ttfb: dict[str, list[float]] = {"direct": [], "mem": [], "a": []}
            before = {name: await added_ttfb(clients[name]) for name in ("mem", "a")}
            for i in range(ttfb_rounds + 20):
                for name in ttfb:
                    value = await ttfb_once(clients[name], f"ttfb-{name}-{i}")
                    if i >= 20:  # the first few warm up
                        ttfb[name].append(value)
            print(f"ttfb, straight to the upstream:      {describe(ttfb['direct'])}")
            print(f"ttfb, through streamfence (memory):  {describe(ttfb['mem'])}")
            print(f"ttfb, through streamfence (redis):   {describe(ttfb['a'])}")
            added = statistics.median(ttfb["a"]) - statistics.median(ttfb["mem"])
            print(f"added by redis vs memory (difference of medians): {added * 1000:.2f} ms")
            for name, label in (("mem", "memory"), ("a", "redis")):
                total, count = await added_ttfb(clients[name])
                mean = (total - before[name][0]) / (count - before[name][1])
                print(f"proxy-measured added ttfb ({label}): mean {mean * 1000:.3f} ms")


def cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_fence")
    parser.add_argument("--rounds", type=int, default=100, help="fence measurements")
    parser.add_argument("--ttfb", type=int, default=300, help="ttfb requests per target")
    parser.add_argument("--cluster", action="store_true", help="a three-master Redis Cluster")
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.ttfb, args.cluster))


if __name__ == "__main__":
    cli()
