"""Stalls behind keep-alives with a Node upstream (tests/node_upstream.js, Node's own `http`:
what many OpenAI-compatible servers and gateways are built on), through real clients, Python
and Node: the stuck stream sends its keep-alive every 50 ms; the client's retry past
healthy_within gets a fresh answer, the stuck client is told it was superseded, and Node sees
the stuck response's connection closed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.clients.conftest import HEALTHY_WITHIN
from tests.clients.node_worker import NODE_CLIENTS, NodeWorker
from tests.clients.pyclients import PYTHON_CLIENTS, Call, Outcome
from tests.conftest import ProxyFactory
from tests.upstream.test_servers import node_seen, node_upstream

pytestmark = pytest.mark.clients

OPENROUTER = ": OPENROUTER PROCESSING\n\n"
ANTHROPIC_PING = 'event: ping\ndata: {"type": "ping"}\n\n'
SSE_STARLETTE = ": ping - 2025-06-01 12:00:00.000000\r\n\r\n"


async def run(request: pytest.FixtureRequest, client: str, call: Call) -> Outcome:
    if client in NODE_CLIENTS:
        worker: NodeWorker = request.getfixturevalue("node_worker")
        return await worker.call(client, call)
    return await asyncio.wait_for(PYTHON_CLIENTS[client](call), 30)


@pytest.mark.parametrize(
    ("client", "keepalive"),
    [
        pytest.param("py-openai-chat", OPENROUTER, id="py-openai-chat-openrouter"),
        pytest.param("py-anthropic", ANTHROPIC_PING, id="py-anthropic-ping"),
        pytest.param("node-anthropic", ANTHROPIC_PING, id="node-anthropic-ping"),
        pytest.param("node-openai-chat", SSE_STARLETTE, id="node-openai-chat-sse-starlette"),
    ],
)
async def test_a_retry_of_a_node_stream_stalled_behind_keepalives_gets_a_fresh_answer(
    request: pytest.FixtureRequest, make_proxy: ProxyFactory, client: str, keepalive: str
) -> None:
    overrides = {"upstream.healthy_within": HEALTHY_WITHIN}
    async with node_upstream() as url, make_proxy(url, **overrides) as proxy:
        held = {
            "x-hold": "stuck",
            "x-prefix": "A",
            "x-keepalive": json.dumps(keepalive),
            "x-keepalive-every": "50",
        }
        a = Call(base=proxy.url, headers=held)
        a_task = asyncio.create_task(run(request, client, a))
        await asyncio.wait_for(a.first.wait(), 20)
        await asyncio.sleep(HEALTHY_WITHIN + 0.2)  # keep-alives only, every 50 ms
        b = Call(base=proxy.url, headers={"x-prefix": "B"})  # the same body: the retry
        winner = await asyncio.wait_for(run(request, client, b), 10)
        loser = await asyncio.wait_for(a_task, 10)
        async with httpx.AsyncClient(timeout=10) as check:  # answers once Node saw it close
            assert (await check.get(url + "/_closed/stuck")).text == "closed"
        seen = await node_seen(url)
    assert winner == Outcome(text="B0 B1 B2 ")
    assert loser.error is not None and "superseded" in loser.message, loser
    assert loser.text == "A0 "
    assert len(seen) == 2
