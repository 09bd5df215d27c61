"""B2 and B3 through a follower on another process, against a follower on the same one.

    python -m bench.remote_follow [--rounds 3] [--smoke]

Processes: a private redis-server, the scripted upstream (bench.upstream), and two
streamfence processes A and B (`python -m proxy`, the Redis registry). Every stream is
asked on A first (the origin); once its first event is in, the very same request (same
body, same X-Turn-Id) is asked again: on A (a local follower) or on B (a remote follower,
which reads A's generation log in Redis). Local and remote rounds alternate.

- B2: one stream of 20,000 events as fast as the upstream writes them. The follower's
  events per second (from its send to its last event) and how long after the origin's
  last event the follower has its own (tail_ms; in B3 the median over the pairs).
- B3: 200 such pairs at once (100 events, 20 ms apart). The followers' gap p99 between two
  events, their wall time from the first send to the last event, and the CPU seconds of
  A and B together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.client import Conn, Result, _pct, connect
from bench.loop import run_fast
from bench.run import ROOT, cpu_seconds, free_port, wait_port
from tests.redis_server import RedisServer

FULL = {
    "B2": {"n": 1, "tokens": 20_000, "delay_ms": 0},
    "B3": {"n": 200, "tokens": 100, "delay_ms": 20},
}
SMOKE = {
    "B2": {"n": 1, "tokens": 2_000, "delay_ms": 0},
    "B3": {"n": 20, "tokens": 20, "delay_ms": 5},
}


async def pair(origin: int, follower: int, spec: dict[str, Any], rid: str) -> tuple[Result, Result]:
    a: Conn = await connect(origin)
    b: Conn = await connect(follower)
    try:
        done_a = a.request(spec["tokens"], spec["delay_ms"], rid, turn=rid, gaps=True)
        assert a.first is not None
        await a.first
        done_b = b.request(spec["tokens"], spec["delay_ms"], rid, turn=rid, gaps=True)
        return await done_a, await done_b
    finally:
        a.close()
        b.close()


async def scenario(origin: int, follower: int, spec: dict[str, Any], tag: str) -> dict[str, Any]:
    start = time.monotonic()
    pairs = await asyncio.gather(
        *(pair(origin, follower, spec, f"{tag}-{i}") for i in range(spec["n"]))
    )
    followers = [b for _, b in pairs]
    want = spec["tokens"] + 2
    whole = sum(1 for b in followers if b.events == want and not b.error and b.status == 200)
    short = [
        (b.status, b.events, b.error, b.last[-200:].decode(errors="replace"))
        for b in followers
        if b.events != want or b.error
    ]
    gaps = [g for b in followers for g in b.gaps]
    tails = [b.done_at - a.done_at for a, b in pairs]
    a, b = pairs[0]
    return {
        "whole": whole,
        "short": short[:2],  # what the first followers that fell short got
        "of": len(followers),
        "wall_s": max(b.done_at for b in followers) - start,
        "gap_p99_ms": _pct(gaps, 0.99) * 1000,
        "events_per_s": b.events / max(1e-9, b.done_at - b.sent_at),
        "tail_ms": _pct(tails, 0.50) * 1000,  # p50 over the pairs
    }


def start_proxy(upstream: int, redis_url: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    args = [sys.executable, "-m", "proxy", "--upstream", f"http://127.0.0.1:{upstream}"]
    args += ["--port", str(port), "--registry-url", redis_url, "--log-level", "warning"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc)
    return proc, port


def measure(rounds: int, plan: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(tmp)
        redis.start()
        up = subprocess.Popen(
            [sys.executable, "-m", "bench.upstream", "--port", "0"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
        )
        assert up.stdout is not None
        up_port = int(up.stdout.readline().split()[1])
        procs = []
        try:
            (pa, port_a), (pb, port_b) = (start_proxy(up_port, redis.url) for _ in range(2))
            procs = [pa, pb]
            time.sleep(1.0)  # both subscribed to the claims channel
            for name, spec in plan.items():
                for r in range(rounds):
                    order = [("local", port_a), ("remote", port_b)]
                    for where, port in order if r % 2 == 0 else order[::-1]:
                        cpu = cpu_seconds([pa.pid, pb.pid])
                        got = run_fast(scenario(port_a, port, spec, f"{name}-{where}-{r}"))
                        got["cpu_s"] = cpu_seconds([pa.pid, pb.pid]) - cpu
                        row = out.setdefault(f"{name} {where}", {})
                        for k, v in got.items():
                            row.setdefault(k, []).append(v)
                        if got["short"]:
                            print(name, where, "short:", got["short"], file=sys.stderr)
        finally:
            for p in [*procs, up]:
                p.terminate()
                p.wait()
            redis.stop()
    return out


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    results = measure(args.rounds, SMOKE if args.smoke else FULL)
    print(json.dumps(results, indent=1))
    for name in ("B2", "B3"):
        local, remote = results[f"{name} local"], results[f"{name} remote"]
        print(
            f"{name}: followers whole {sum(local['whole']):.0f}/{sum(local['of']):.0f} local, "
            f"{sum(remote['whole']):.0f}/{sum(remote['of']):.0f} remote"
        )
        for key in ("events_per_s", "tail_ms", "wall_s", "gap_p99_ms", "cpu_s"):
            lo, re = median(local[key]), median(remote[key])
            ratio = re / lo if lo else float("nan")
            print(f"  {key:13s} local {lo:10.2f}  remote {re:10.2f}  remote/local {ratio:5.2f}")


if __name__ == "__main__":
    main()
