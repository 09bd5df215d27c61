"""What join/adaptive saves against supersede: `python -m bench.join_savings`.

A scripted workload: N turns, each streaming TOKENS tokens after a first-token delay (the
model's prefill). Every turn is retried once, mid-stream: for half of them the stream is
healthy (still producing), for the other half it has stalled (the provider went silent). The
same workload runs through streamfence with on_retry = supersede and = adaptive, and reports
the upstream requests, the tokens the upstream generated, and the time to first byte of the
retry (its first token event at the client). Everything runs on 127.0.0.1 in one process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from proxy.config.load import load
from proxy.demo import until_disconnect
from proxy.server.app import create_app
from tests.scripted import serve


class Provider:
    """Streams `tokens` chunks `pace` apart after `first_token` seconds. The first request
    of a turn whose body says `stall` goes silent after `stall_after` tokens."""

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self._seen: set[str] = set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        body = json.loads(raw)
        job = body["job"]
        first_of_turn = job["turn"] not in self._seen
        self._seen.add(job["turn"])
        self.requests += 1
        await until_disconnect(receive, self._stream(job, first_of_turn and job["stall"], send))

    async def _stream(self, job: dict[str, Any], stall: bool, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await asyncio.sleep(job["first_token"])
        for i in range(job["tokens"]):
            if stall and i == job["stall_after"]:
                await asyncio.sleep(3600)
            chunk = {"choices": [{"index": 0, "delta": {"content": f"{i} "}}]}
            data = f"data: {json.dumps(chunk)}\n\n".encode()
            await send({"type": "http.response.body", "body": data, "more_body": True})
            self.tokens += 1
            await asyncio.sleep(job["pace"])
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _first_token(client: httpx.AsyncClient, body: dict[str, Any], turn: str) -> float:
    """Send a retry; return its time to first token; read it to the end."""
    start = time.perf_counter()
    ttfb = 0.0
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Turn-Id": turn}
    ) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and not ttfb:
                ttfb = time.perf_counter() - start
    return ttfb


async def _turn(client: httpx.AsyncClient, i: int, args: argparse.Namespace) -> float:
    job = {
        "turn": f"t{i}",
        "tokens": args.tokens,
        "pace": args.pace,
        "first_token": args.first_token,
        "stall": i % 2 == 1,
        "stall_after": args.retry_at,
    }
    body = {
        "model": "m",
        "stream": True,
        "job": job,
        "messages": [{"role": "user", "content": f"question {i}"}],
    }
    seen = asyncio.Event()
    count = 0

    async def first_attempt() -> None:
        nonlocal count
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Turn-Id": job["turn"]}
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    count += 1
                    if count == args.retry_at:
                        seen.set()

    task = asyncio.create_task(first_attempt())
    await seen.wait()
    # A healthy stream keeps going; a stalled one is past healthy_within when the agent
    # gives up on it, as a real agent's read timeout would be.
    await asyncio.sleep(args.agent_timeout if job["stall"] else args.pace / 2)
    ttfb = await _first_token(client, body, job["turn"])
    await task
    return ttfb


async def _run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    provider = Provider()
    async with serve(provider) as (provider_url, _):
        overrides = {
            "upstream.url": provider_url,
            "upstream.on_retry": mode,
            "upstream.healthy_within": args.healthy_within,
        }
        app = create_app(load(env={}, overrides=overrides))
        async with serve(app) as (proxy_url, _):
            async with httpx.AsyncClient(base_url=proxy_url, timeout=60) as client:
                ttfbs = await asyncio.gather(*(_turn(client, i, args) for i in range(args.turns)))
    healthy = [t for i, t in enumerate(ttfbs) if i % 2 == 0]
    stalled = [t for i, t in enumerate(ttfbs) if i % 2 == 1]
    return {
        "mode": mode,
        "upstream_requests": provider.requests,
        "tokens_generated": provider.tokens,
        "retry_ttfb_ms_healthy_p50": round(statistics.median(healthy) * 1000, 2),
        "retry_ttfb_ms_stalled_p50": round(statistics.median(stalled) * 1000, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--tokens", type=int, default=60)
    p.add_argument("--pace", type=float, default=0.01)
    p.add_argument("--first-token", type=float, default=0.3, help="the model's prefill, seconds")
    p.add_argument("--retry-at", type=int, default=20, help="tokens seen before the retry")
    p.add_argument("--healthy-within", type=float, default=0.25)
    p.add_argument("--agent-timeout", type=float, default=0.5)
    args = p.parse_args()
    results = [asyncio.run(_run(mode, args)) for mode in ("supersede", "adaptive")]
    for r in results:
        print(json.dumps(r))
    s, a = results
    print(
        f"adaptive vs supersede: upstream requests {a['upstream_requests']} vs "
        f"{s['upstream_requests']} ({s['upstream_requests'] - a['upstream_requests']} saved), "
        f"tokens generated {a['tokens_generated']} vs {s['tokens_generated']} "
        f"({s['tokens_generated'] - a['tokens_generated']} saved); retry TTFB on a healthy "
        f"stream {a['retry_ttfb_ms_healthy_p50']} ms joined vs "
        f"{s['retry_ttfb_ms_healthy_p50']} ms superseding"
    )


if __name__ == "__main__":
    main()
