"""Stress, WebSocket mode: many sockets, each running several responses in turn, a random
share of them superseded mid-stream by the identical request over a new socket. Every
response is checked: it ends with response.completed and its own whole text, or with exactly
one stream_superseded error and nothing of it after; a rival always completes; nothing is
left (leases, upstream sockets, relays).

CI size: STREAMFENCE_WS_STRESS_SOCKETS (default 40) sockets x 5 responses; the seed is
printed and can be pinned with STREAMFENCE_STRESS_SEED.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.conftest import ProxyFactory
from tests.ws_upstream import WsUpstream, ws_upstream

pytestmark = pytest.mark.stress

SOCKETS = int(os.environ.get("STREAMFENCE_WS_STRESS_SOCKETS", "40"))
RESPONSES = 5
SEED = int(os.environ.get("STREAMFENCE_STRESS_SEED", str(random.randrange(1 << 32))))
TERMINAL = ("response.completed", "response.failed", "response.incomplete", "error")


@pytest.fixture
async def wsup() -> AsyncIterator[WsUpstream]:
    async with ws_upstream() as upstream:
        yield upstream


def message(text: str, tokens: int, prefix: str) -> str:
    script = {"tokens": tokens, "prefix": prefix, "delay": 0.02}
    return json.dumps({"type": "response.create", "model": "m", "input": text, "script": script})


async def one_response(ws: ClientConnection, on_event: Any = None) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while True:
        event = json.loads(await ws.recv())
        events.append(event)
        if on_event is not None:
            on_event(len(events))
        if event["type"] in TERMINAL:
            return events


def check(events: list[dict[str, Any]], prefix: str, tokens: int) -> str:
    """The response's outcome; AssertionError for any broken promise."""
    kinds = [e["type"] for e in events]
    assert kinds.count("response.completed") + kinds.count("error") == 1, kinds
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    if kinds[-1] == "response.completed":
        assert text == "".join(f"{prefix}{i} " for i in range(tokens)), text
        return "completed"
    last = events[-1]
    assert last["type"] == "error" and last["code"] == "stream_superseded", last
    assert text == "".join(f"{prefix}{i} " for i in range(len(text.split()))), text
    return "superseded"


async def socket_run(
    url: str,
    rng: random.Random,
    n: int,
    outcomes: dict[str, int],
    tasks: set[Any],
    pool: asyncio.Queue[ClientConnection],
) -> None:
    async with connect(url) as ws:
        for j in range(RESPONSES):
            tokens = rng.randint(2, 6)
            text = f"socket {n} response {j}"
            rival_at = rng.randint(1, tokens + 1) if rng.random() < 0.4 else None
            await ws.send(message(text, tokens, f"o{n}.{j}-"))

            def maybe_rival(received: int, at: int | None = rival_at, t: str = text) -> None:
                if at is not None and received == at:
                    task = asyncio.ensure_future(rival(pool, t, rng.randint(1, 4), outcomes))
                    tasks.add(task)

            events = await one_response(ws, maybe_rival)
            outcomes[check(events, f"o{n}.{j}-", tokens)] += 1


async def rival(
    pool: asyncio.Queue[ClientConnection], text: str, tokens: int, outcomes: dict[str, int]
) -> None:
    """The retry, over another socket (already open: under load a new socket's two
    handshakes can take longer than the response it is meant to supersede)."""
    ws = await pool.get()
    await ws.send(message(text, tokens, "r-"))
    events = await one_response(ws)
    assert check(events, "r-", tokens) == "completed"
    outcomes["rival_completed"] += 1
    pool.put_nowait(ws)


async def test_many_sockets_many_responses_random_supersedes(
    wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    overrides = {
        "upstream.on_retry": "supersede",
        "turns.ignore_fields": "stream,stream_options,timeout,script",
    }
    outcomes = {"completed": 0, "superseded": 0, "rival_completed": 0}
    tasks: set[Any] = set()
    async with make_proxy(wsup.url, **overrides) as proxy:
        url = proxy.url.replace("http://", "ws://") + "/v1/responses"
        pool: asyncio.Queue[ClientConnection] = asyncio.Queue()
        rivals = [await connect(url) for _ in range(max(4, SOCKETS // 4))]
        for ws in rivals:
            pool.put_nowait(ws)
        runs = (socket_run(url, rng, n, outcomes, tasks, pool) for n in range(SOCKETS))
        await asyncio.wait_for(asyncio.gather(*runs), 120)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for ws in rivals:
            await ws.close()
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0
        assert not proxy.runtime.active
        for conn in wsup.conns:
            await asyncio.wait_for(conn.closed.wait(), 10)
    print(outcomes)
    assert outcomes["completed"] + outcomes["superseded"] == SOCKETS * RESPONSES
    assert outcomes["rival_completed"] == len(tasks)
    assert outcomes["superseded"] > 0  # the schedule did supersede something
    assert outcomes["superseded"] <= len(tasks)
