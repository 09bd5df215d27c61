"""Shutdown as a supervisor sees it: the default grace fits inside Docker's and Kubernetes'
default stop timeouts, and a stream the shutdown ends is logged as `shutdown`, not as an
upstream error."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import httpx

from proxy import shutdown
from proxy.config import ServerConfig
from tests.sse_client import chat_body, events
from tests.upstream import ScriptedUpstream

ROOT = Path(__file__).resolve().parent.parent
DOCKER_STOP_TIMEOUT = 10  # `docker stop`, compose's stop_grace_period
KUBERNETES_TERMINATION_GRACE = 30  # a Pod's terminationGracePeriodSeconds


def test_the_default_grace_ends_before_docker_or_kubernetes_kill_the_process() -> None:
    # uvicorn cancels what still runs at grace + margin; the process exits right after.
    # At 10 s (the old default) `docker stop` killed it with 137 mid-stream.
    worst = shutdown.uvicorn_timeout(ServerConfig().shutdown_grace)
    assert worst < DOCKER_STOP_TIMEOUT
    assert worst < KUBERNETES_TERMINATION_GRACE


async def test_a_stream_ended_by_the_shutdown_is_logged_as_shutdown(
    upstream: ScriptedUpstream,
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "proxy", "--upstream", upstream.url, "--port", "0"],
        env={**clean, "STREAMFENCE_SERVER_SHUTDOWN_GRACE": "0.3"},
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stderr is not None
    try:
        url = json.loads(await asyncio.wait_for(proc.stderr.readline(), 30))["msg"].split()[-1]
        async with (
            httpx.AsyncClient(base_url=url, timeout=20) as client,
            client.stream(
                "POST", "/v1/chat/completions", json=chat_body(gated=True, tokens=5)
            ) as response,
        ):
            stream = events(response)
            await anext(stream)
            proc.send_signal(signal.SIGTERM)
            rest = [e async for e in stream]
        assert [e.json["error"]["code"] for e in rest] == ["shutting_down"]
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = [json.loads(line) for line in (await proc.stderr.read()).splitlines()]
    (request,) = [line for line in lines if line["msg"] == "request"]
    # The proxy ended it, not the upstream: operators must not be sent looking upstream.
    assert (request["outcome"], request["error"]) == ("shutdown", "shutting_down")
