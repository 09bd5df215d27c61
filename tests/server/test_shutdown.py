"""Shutdown as a supervisor sees it: the default grace fits inside Docker's and Kubernetes'
default stop timeouts, a stream the shutdown ends is logged as `shutdown`, not as an
upstream error, one line says what the stop waits for and one when it is over, and an idle
proxy stops at once."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from proxy.config.schema import ServerConfig
from proxy.server import shutdown
from tests.scripted import ScriptedUpstream
from tests.sse_client import chat_body, events

ROOT = Path(__file__).resolve().parents[2]
DOCKER_STOP_TIMEOUT = 10  # `docker stop`, compose's stop_grace_period
KUBERNETES_TERMINATION_GRACE = 30  # a Pod's terminationGracePeriodSeconds


def test_the_default_grace_ends_before_docker_or_kubernetes_kill_the_process() -> None:
    # uvicorn cancels what still runs at grace + margin; the process exits right after.
    # At 10 s (the old default) `docker stop` killed it with 137 mid-stream.
    worst = shutdown.uvicorn_timeout(ServerConfig().shutdown_grace)
    assert worst < DOCKER_STOP_TIMEOUT
    assert worst < KUBERNETES_TERMINATION_GRACE


@asynccontextmanager
async def _proxy(upstream: ScriptedUpstream, grace: float) -> AsyncIterator[Process]:
    """The real command (JSON logs on a pipe), with its startup line read."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "proxy", "--upstream", upstream.url, "--port", "0"],
        env={**clean, "STREAMFENCE_SERVER_SHUTDOWN_GRACE": str(grace)},
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stderr is not None
    try:
        line = await asyncio.wait_for(proc.stderr.readline(), 30)
        yield Process(proc, json.loads(line)["msg"].split()[-1])
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


class Process:
    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc, self.url = proc, url

    async def line(self, msg_start: str) -> dict[str, Any]:
        """The next log line whose message starts with `msg_start`."""
        assert self.proc.stderr is not None
        while True:
            raw = await asyncio.wait_for(self.proc.stderr.readline(), 20)
            assert raw, f"the process ended before saying {msg_start!r}"
            line: dict[str, Any] = json.loads(raw)
            if line["msg"].startswith(msg_start):
                return line

    async def rest(self) -> list[dict[str, Any]]:
        assert self.proc.stderr is not None
        return [json.loads(line) for line in (await self.proc.stderr.read()).splitlines()]


async def test_a_stream_ended_by_the_shutdown_is_logged_as_shutdown(
    upstream: ScriptedUpstream,
) -> None:
    async with _proxy(upstream, grace=0.3) as p:
        async with (
            httpx.AsyncClient(base_url=p.url, timeout=20) as client,
            client.stream(
                "POST", "/v1/chat/completions", json=chat_body(gated=True, tokens=5)
            ) as response,
        ):
            stream = events(response)
            await anext(stream)
            p.proc.send_signal(signal.SIGTERM)
            rest = [e async for e in stream]
        assert [e.json["error"]["code"] for e in rest] == ["shutting_down"]
        assert await asyncio.wait_for(p.proc.wait(), 20) == 0
        lines = await p.rest()
    (request,) = [line for line in lines if line["msg"] == "request"]
    # The proxy ended it, not the upstream: operators must not be sent looking upstream.
    assert (request["outcome"], request["error"]) == ("shutdown", "shutting_down")
    # What the stop waits for, then what it had to end: never a silent wait.
    said = [(line["logger"], line["msg"]) for line in lines if line["logger"].endswith("down")]
    assert said[0] == (
        "streamfence.shutdown",
        "shutting down: 1 request in flight; waiting up to 0.3 s for them to finish, then "
        "each gets an error event (a second signal ends them now)",
    )
    assert said[-1][1].startswith("stopped after ")
    assert said[-1][1].endswith(" s: 1 request ended by the shutdown")
    assert len(said) == 2


async def test_a_stream_that_finishes_within_the_grace_ends_the_wait(
    upstream: ScriptedUpstream,
) -> None:
    async with _proxy(upstream, grace=30) as p:
        async with (
            httpx.AsyncClient(base_url=p.url, timeout=20) as client,
            client.stream(
                "POST", "/v1/chat/completions", json=chat_body(gated=True, tokens=2)
            ) as response,
        ):
            stream = events(response)
            await anext(stream)
            p.proc.send_signal(signal.SIGTERM)
            starting = await p.line("shutting down")
            assert starting["msg"].startswith(
                "shutting down: 1 request in flight; waiting up to 30 s"
            )
            upstream.seen[0].release(10)  # the stream finishes on its own
            assert [e async for e in stream][-1].data == "[DONE]"
        assert await asyncio.wait_for(p.proc.wait(), 20) == 0
        ended = await p.line("stopped after ")
    seconds = float(ended["msg"].split()[2])
    assert seconds < 15 and ended["msg"].endswith(": every request in flight finished")


async def test_an_idle_proxy_stops_at_once(upstream: ScriptedUpstream) -> None:
    async with _proxy(upstream, grace=30) as p:
        async with httpx.AsyncClient(base_url=p.url, timeout=20) as client:
            assert (await client.get("/_streamfence/healthz")).status_code == 200  # keep-alive
            started = time.perf_counter()
            p.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(p.proc.wait(), 20) == 0
        took = time.perf_counter() - started
        lines = [line["msg"] for line in await p.rest() if line["logger"].endswith("down")]
    assert lines[0] == "shutting down: nothing in flight, stopping now"
    assert re.fullmatch(r"stopped after \d+\.\d s", lines[-1]), lines
    assert float(lines[-1].split()[2]) < 5
    assert took < 5  # not the 30 s grace: nothing to wait for (margin for a loaded machine)
