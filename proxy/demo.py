"""`streamfence demo`: the fence, live, with no network and no key.

A scripted provider and the proxy run on 127.0.0.1. An agent streams an answer; the
provider stalls mid-way, so the agent retries while the first stream is still alive. Run
once straight to the provider (both streams write into the transcript) and once through
streamfence (the first attempt is fenced, only the retry's tokens arrive).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn

from proxy.config.load import load
from proxy.config.schema import UpstreamConfig
from proxy.ops.ledger import Ledger
from proxy.server.app import create_app

ANSWER = "The capital of France is Paris . It sits on the Seine .".split()
STALL_AFTER = 4  # tokens the first attempt sends before it stalls
DEFAULT_HEALTHY_WITHIN = UpstreamConfig.healthy_within


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


WIDTH = 80


class PipeClosed(Exception):
    """Whoever reads the demo's output has gone (`streamfence demo | head -3`)."""


class Out:
    """The demo's stdout. Once its reader has gone every write raises PipeClosed, whichever
    task makes it (the provider's server included), so the demo stops instead of waiting on
    a task that died."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    def __call__(self, text: str = "") -> None:
        if self.closed.is_set():
            raise PipeClosed
        try:
            print(text, flush=True)
        except BrokenPipeError:
            self.closed.set()
            raise PipeClosed from None


class Screen:
    def __init__(self, out: Out, color: bool) -> None:
        self.t0 = time.perf_counter()
        self.out = out
        self.color = color

    def say(self, who: str, text: str, tone: str = "") -> None:
        codes = {"a1": "33", "a2": "32", "fence": "1;31", "note": "2"}
        ms = (time.perf_counter() - self.t0) * 1000
        head = f"  [{ms:5.0f} ms] {who:<9} "
        # Long texts (the proxy's message) wrap under themselves: the demo fits 80 columns.
        lines = textwrap.wrap(text, WIDTH - len(head)) or [""]
        for i, part in enumerate(lines):
            line = (head if i == 0 else " " * len(head)) + part
            if self.color and tone in codes:
                line = f"\033[{codes[tone]}m{line}\033[0m"
            self.out(line)


class Provider:
    """Streams ANSWER as chat-completion chunks; the first request of a turn stalls."""

    def __init__(self, pace: float, screen: Screen) -> None:
        self.pace = pace
        self.screen = screen
        self.requests = 0
        self.generated = 0  # tokens sent, over all attempts: what the provider would bill
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
                self.generated += 1
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        except asyncio.CancelledError:
            self.closed.append((attempt, sent))
            with contextlib.suppress(PipeClosed):  # the demo is stopping anyway
                self.screen.say(
                    "provider",
                    f"attempt {attempt}: connection closed after {sent} tokens, generation stopped",
                    "fence",
                )
            raise


class _QuietServer(uvicorn.Server):
    """Leaves the signals alone: Ctrl-C is the demo's to handle (it stops the whole demo),
    not a reason for each scripted server to start a graceful shutdown of its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@asynccontextmanager
async def _serve(app: Any) -> AsyncIterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="error", lifespan="auto", ws="none", http="httptools")
    server = _QuietServer(config)
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
        stalled = asyncio.create_task(retry.wait())
        try:
            await asyncio.wait({first, stalled}, return_when=asyncio.FIRST_COMPLETED)
            if not stalled.done():  # attempt 1 ended (or failed) before its stall
                await first
                raise RuntimeError("the first attempt ended before the provider stalled")
            await asyncio.sleep(pace * 4)  # the agent's stall timeout
            screen.say("agent", "no token for a while: retrying the same request", "note")
            await attempt(2, client)
            await first
        finally:  # whatever went wrong, no attempt outlives the demo's client
            stalled.cancel()
            first.cancel()
            await asyncio.gather(first, stalled, return_exceptions=True)
    return transcript


def _after_retry(transcript: list[tuple[int, str]]) -> str:
    tokens = transcript[STALL_AFTER:]
    return " ".join(f"{tok.strip()}({n})" for n, tok in tokens)


async def demo(pace: float, color: bool, out: Out) -> int:
    out("streamfence demo: a scripted provider and the proxy on 127.0.0.1 (no network,")
    out("no key). An agent streams an answer; the provider stalls after 4 tokens; the")
    out("agent retries while the first stream is still alive. Tokens after the retry,")
    out("with their attempt number:")
    out()
    out("1) Straight to the provider:")
    screen = Screen(out, color)
    straight = Provider(pace, screen)
    async with _serve(straight) as provider_url:
        direct = await _agent(provider_url, screen, pace)
    out()
    _tokens(out, direct)
    out("   -> two answers interleaved token by token, and the provider generated both.")
    out()
    # The agent retries after 4 paces of silence; the proxy calls a generation stalled
    # after 2 (healthy_within: in real use, under the agent's own stall timeout). Said on
    # screen: a user who retried after 4 s with the defaults got "followed" and wondered.
    healthy_within = pace * 2
    out("2) Through streamfence (the agent's base_url points at the proxy):")
    _wrapped(
        out,
        f"For the show, healthy_within is {healthy_within:g} s (twice the pace): a stream "
        "silent that long is stalled, and a retry replaces it. The default is "
        f"{DEFAULT_HEALTHY_WITHIN:g} s: a retry within {DEFAULT_HEALTHY_WITHIN:g} s of the "
        "last token follows the running stream (one upstream request for both); after a "
        "longer silence it replaces the stream. Keep it below your agent's own stall "
        "timeout.",
    )
    screen = Screen(out, color)
    provider = Provider(pace, screen)
    async with _serve(provider) as provider_url:
        overrides = {"upstream.url": provider_url, "upstream.healthy_within": healthy_within}
        app = create_app(load(env={}, overrides=overrides))
        async with _serve(app) as proxy_url:
            fenced = await _agent(proxy_url, screen, pace)
    ok = [n for n, _ in fenced[STALL_AFTER:]] == [2] * len(ANSWER) and provider.closed != []
    out()
    _tokens(out, fenced)
    out("   -> attempt 1 was fenced the moment attempt 2 arrived: its upstream")
    out("      connection closed, its client told plainly not to retry. Only attempt")
    out("      2's tokens were delivered.")
    out()
    out(f"{'OK' if ok else 'UNEXPECTED'}: one writer per turn.")
    _spared(out, app.state.runtime.ledger, straight.generated, provider.generated)
    return 0 if ok else 1


def _spared(out: Out, ledger: Ledger, straight: int, fenced: int) -> None:
    """The demo's last line: the tokens the fence spared the provider (each provider counts
    what it generated), and the proxy's ledger of the requests it sent and fenced."""
    rows = ledger.summary()
    requests, cut = sum(r["requests"] for r in rows), sum(r["fenced"] for r in rows)
    out(
        f"Spared by the fence: {straight - fenced} of {straight} generated tokens "
        f"({requests} requests upstream, {cut} fenced)."
    )


def _tokens(out: Out, transcript: list[tuple[int, str]]) -> None:
    text = "after the retry: " + _after_retry(transcript)
    for line in textwrap.wrap(text, WIDTH - 3, subsequent_indent="  "):
        out("   " + line)


def _wrapped(out: Out, text: str) -> None:
    for line in textwrap.wrap(text, WIDTH - 3):
        out("   " + line)


def use_color(no_color: bool) -> bool:
    """Colours only on a terminal, and never with --no-color or NO_COLOR set
    (https://no-color.org: any non-empty value)."""
    return sys.stdout.isatty() and not no_color and not os.environ.get("NO_COLOR")


async def _main(pace: float, color: bool) -> int:
    out = Out()
    task = asyncio.create_task(demo(pace, color, out))
    closed = asyncio.create_task(out.closed.wait())
    try:
        await asyncio.wait({task, closed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # The reader gone (the write that noticed may have been another task's), or Ctrl-C
        # cancelling this task: stop the demo, and so its servers, before the loop closes.
        closed.cancel()
        task.cancel()
        (result,) = await asyncio.gather(task, return_exceptions=True)
    if isinstance(result, int):
        return result
    if isinstance(result, PipeClosed | asyncio.CancelledError):
        return 0
    raise result


def run_demo(pace: float = 0.12, *, no_color: bool = False) -> int:
    try:
        code = asyncio.run(_main(pace, use_color(no_color)))
    except KeyboardInterrupt:
        code = 130  # 128 + SIGINT, as a shell reports it; no traceback
    if code == 0 and not sys.stdout.closed:
        _quiet_stdout_if_gone()
    return code


def _quiet_stdout_if_gone() -> None:
    # The interpreter flushes stdout at exit; with its reader gone that flush would print
    # "Exception ignored ... BrokenPipeError". Pointing stdout at /dev/null first is the
    # recipe from Python's signal docs ("Note on SIGPIPE").
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
