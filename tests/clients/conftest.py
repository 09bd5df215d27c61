from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from proxy.server.listen import Loop
from tests.clients.node_worker import NODE_CLIENTS, NodeWorker, node_missing
from tests.clients.pyclients import CLEANUP, LIBRARIES, PYTHON_CLIENTS, Call, Outcome
from tests.conftest import PROXY_LOOP, Proxy, ProxyFactory
from tests.scripted import ScriptedUpstream

# Small, so that a stall is quick to reach; above the 50 ms between twins and the scripted
# upstream's 0.1-0.3 s between events, so that a live stream stays healthy.
HEALTHY_WITHIN = 0.4
ALL_CLIENTS = (*PYTHON_CLIENTS, *NODE_CLIENTS)


@pytest.fixture(scope="session")
def node_worker() -> Iterator[NodeWorker]:
    reason = node_missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the Node clients cannot run: {reason}")
        pytest.skip(reason)
    worker = NodeWorker()
    yield worker
    worker.close()


@dataclass
class World:
    """The proxy (healthy_within small) in front of the scripted upstream, and one client
    library to drive through it."""

    client: str
    proxy: Proxy
    upstream: ScriptedUpstream
    node: NodeWorker | None

    def call(self, **kw: Any) -> Call:
        return Call(base=self.proxy.url, **kw)

    async def run(self, call: Call) -> Outcome:
        if self.node is not None:
            return await self.node.call(self.client, call)
        return await asyncio.wait_for(PYTHON_CLIENTS[self.client](call), 30)

    def start(self, call: Call) -> asyncio.Task[Outcome]:
        return asyncio.create_task(self.run(call))


@pytest.fixture
async def world(
    request: pytest.FixtureRequest, upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> AsyncIterator[World]:
    client: str = request.param
    assert isinstance(asyncio.get_running_loop(), Loop)  # streamfence's own (anyio_backend)
    node = request.getfixturevalue("node_worker") if client in NODE_CLIENTS else None
    if client in LIBRARIES:
        importlib.import_module(LIBRARIES[client])  # before the scenario: see LIBRARIES
    async with make_proxy(upstream.url, **{"upstream.healthy_within": HEALTHY_WITHIN}) as proxy:
        yield World(client, proxy, upstream, node)
        for seen in upstream.seen:  # nothing of a scenario stays held open
            seen.release(1000)
        await asyncio.wait_for(proxy.runtime.wait_idle(), 10)
    if client in CLEANUP:
        await CLEANUP[client]()


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return PROXY_LOOP  # every connection through streamfence's own accept loop
