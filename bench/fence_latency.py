"""Fence latency, one supersede at a time: `python -m bench.fence_latency [N]`.

For each of N turns: a streaming attempt is in flight (its scripted upstream holds the next
event), then a retry of the same turn is sent. Two figures per supersede, both ending when the
upstream server sees its connection closed (`Seen.closed_at`):
  - from the proxy's claim of the retry (the moment the newer attempt was accepted), and
  - from the moment the client started sending the retry (an upper bound on arrival).
The proxy, the upstream and the client share one process and one clock (perf_counter), so the
figures are exact but include event-loop sharing; B5 of `python -m bench` measures the same
thing under load with separate processes.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import httpx

from proxy.config.load import load
from proxy.server.app import create_app
from tests.scripted import ScriptedUpstream, serve

CHAT = "/v1/chat/completions"


async def measure(n: int) -> tuple[list[float], list[float]]:
    upstream = ScriptedUpstream()
    from_claim: list[float] = []
    from_send: list[float] = []
    async with serve(upstream) as (upstream_url, _):
        app = create_app(load(env={}, overrides={"upstream.url": upstream_url}))
        runtime = app.state.runtime
        async with serve(app) as (proxy_url, _), httpx.AsyncClient(base_url=proxy_url) as client:
            for i in range(n):
                body = {
                    "model": "m",
                    "stream": True,
                    "script": {"gated": True, "tokens": 5},
                    "messages": [{"role": "user", "content": f"turn {i}"}],
                }
                turn = {"X-Turn-Id": f"turn-{i}"}
                async with client.stream("POST", CHAT, json=body, headers=turn) as old:
                    await anext(old.aiter_raw())
                    seen = upstream.seen[-1]
                    lease = next(r.lease for r in runtime.active if r.lease is not None)
                    sent = time.perf_counter()
                    retry = asyncio.create_task(
                        client.post(
                            CHAT, json={**body, "stream": False, "script": {}}, headers=turn
                        )
                    )
                    await seen.closed.wait()
                    assert seen.closed_at is not None and lease.superseded_at is not None
                    from_claim.append(seen.closed_at - lease.superseded_at)
                    from_send.append(seen.closed_at - sent)
                    await retry
    return from_claim, from_send


def _summary(name: str, values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    return (
        f"{name}: median {statistics.median(ms):.3f} ms, p99 {ms[int(len(ms) * 0.99) - 1]:.3f}"
        f" ms, worst {ms[-1]:.3f} ms (n={len(ms)})"
    )


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    from_claim, from_send = asyncio.run(measure(n))
    print(_summary("retry accepted -> old upstream closed", from_claim))
    print(_summary("retry sent by client -> old upstream closed", from_send))


if __name__ == "__main__":
    main()
