"""`streamfence demo`: the fence, live, with no network and no key.

A scripted provider and the proxy run on 127.0.0.1. An agent streams an answer; the
provider stalls mid-way, so the agent retries while the first stream is still alive. Run
once straight to the provider (both streams write into the transcript) and once through
streamfence (the first attempt is fenced, only the retry's tokens arrive).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn

from proxy.app import create_app
from proxy.config import load

ANSWER = "The capital of France is Paris . It sits on the Seine .".split()
STALL_AFTER = 4  # tokens the first attempt sends before it stalls


async def until_disconnect(receive: Any, work: Coroutine[Any, Any, None]) -> None:
    """Run a provider's `work`, cancelled the moment its client closes the connection:
    how a real provider stops generating when the proxy fences an attempt."""
    task = asyncio.create_task(work)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        await task
    except asyncio.CancelledError:
        pass
    finally:
        watcher.cancel()


class Screen:
    def __init__(self, color: bool) -> None:
        self.t0 = time.perf_counter()
        self.color = color

    def say(self, who: str, text: str, tone: str = "") -> None:
        codes = {"a1": "33", "a2": "32", "fence": "1;31", "note": "2"}
        ms = (time.perf_counter() - self.t0) * 1000
        line = f"  [{ms:6.0f} ms] {who:<10} {text}"
        if self.color and tone in codes:
            line = f"\033[{codes[tone]}m{line}\033[0m"
        print(line, flush=True)


class Provider:
    """Streams ANSWER as chat-completion chunks; the first request of a turn stalls."""

    def __init__(self, pace: float, screen: Screen) -> None:
        self.pace = pace
        self.screen = screen
        self.requests = 0
        self.closed: list[tuple[int, int]] = []  # (attempt, tokens sent) seen closed early

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.requests += 1
        attempt = self.requests
        await until_disconnect(receive, self._stream(attempt, send))

    async def _stream(self, attempt: int, send: Any) -> None:
        sent = 0
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            for i, token in enumerate(ANSWER):
                stall = attempt == 1 and i == STALL_AFTER
                await asyncio.sleep(self.pace * (12 if stall else 1))
                chunk = {
                    "object": "chat.completion.chunk",
                    "model": "demo",
                    "choices": [{"index": 0, "delta": {"content": token + " "}}],
                }
                await send(
                    {
                        "type": "http.response.body",
                        "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True,
                    }
                )
                sent += 1
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        except asyncio.CancelledError:
            self.closed.append((attempt, sent))
            self.screen.say(
                "provider",
                f"attempt {attempt}: connection closed after {sent} tokens, generation stopped",
                "fence",
            )
            raise


@asynccontextmanager
async def _serve(app: Any) -> AsyncIterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="error", lifespan="auto", ws="none", http="httptools")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no "started" event to await
        await asyncio.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


async def _agent(base: str, screen: Screen, pace: float) -> list[tuple[int, str]]:
    """A naive agent: on a stall it retries, and never stops reading the first stream."""
    body = {
        "model": "demo",
        "stream": True,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    transcript: list[tuple[int, str]] = []
    retry = asyncio.Event()

    async def attempt(n: int, client: httpx.AsyncClient) -> None:
        tone = f"a{n}"
        screen.say(f"attempt {n}", "POST /v1/chat/completions (stream)", tone)
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    screen.say(f"attempt {n}", f"error: {data['error']['code']}", "fence")
                    screen.say("", f'"{data["error"]["message"]}"', "note")
                    return
                token = data["choices"][0]["delta"]["content"]
                transcript.append((n, token))
                screen.say(f"attempt {n}", f"<- {token!r}", tone)
                if n == 1 and len(transcript) == STALL_AFTER:
                    retry.set()
        screen.say(f"attempt {n}", "stream finished", tone)

    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        first = asyncio.create_task(attempt(1, client))
        await retry.wait()
        await asyncio.sleep(pace * 4)  # the agent's stall timeout
        screen.say("agent", "no token for a while: retrying the same request", "note")
        await attempt(2, client)
        await first
    return transcript


def _after_retry(transcript: list[tuple[int, str]]) -> str:
    tokens = transcript[STALL_AFTER:]
    return " ".join(f"{tok.strip()}({n})" for n, tok in tokens)


async def demo(pace: float, color: bool) -> int:
    print("streamfence demo: a scripted provider and the proxy on 127.0.0.1 (no network, no key)")
    print("An agent streams an answer; the provider stalls after 4 tokens; the agent retries while")
    print("the first stream is still alive. Tokens after the retry, with their attempt number:\n")
    print("1) Straight to the provider:")
    screen = Screen(color)
    async with _serve(Provider(pace, screen)) as provider_url:
        direct = await _agent(provider_url, screen, pace)
    print(f"\n   after the retry: {_after_retry(direct)}")
    print("   -> two answers interleaved token by token, and the provider generated both.\n")

    print("2) Through streamfence (the agent's base_url points at the proxy):")
    screen = Screen(color)
    provider = Provider(pace, screen)
    async with _serve(provider) as provider_url:
        # The agent retries after 4 paces of silence; the proxy calls a generation stalled
        # after 2 (healthy_within: in real use, under the agent's own stall timeout).
        overrides = {"upstream.url": provider_url, "upstream.healthy_within": pace * 2}
        app = create_app(load(env={}, overrides=overrides))
        async with _serve(app) as proxy_url:
            fenced = await _agent(proxy_url, screen, pace)
    ok = [n for n, _ in fenced[STALL_AFTER:]] == [2] * len(ANSWER) and provider.closed != []
    print(f"\n   after the retry: {_after_retry(fenced)}")
    print(
        "   -> attempt 1 was fenced the moment attempt 2 arrived: its upstream connection closed,"
    )
    print("      its client told plainly not to retry. Only attempt 2's tokens were delivered.")
    print(f"\n{'OK' if ok else 'UNEXPECTED'}: one writer per turn.")
    return 0 if ok else 1


def run_demo(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog="streamfence demo", description=__doc__)
    parser.add_argument("--pace", type=float, default=0.12, help="seconds between tokens")
    parser.add_argument("--no-color", action="store_true")
    args = parser.parse_args(list(argv))
    return asyncio.run(demo(args.pace, sys.stdout.isatty() and not args.no_color))
