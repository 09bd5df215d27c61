from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.server.listen import Loop
from tests.agents.harness import RUNNING
from tests.conftest import PROXY_LOOP


@pytest.fixture(autouse=True)
async def _reap_agents() -> AsyncIterator[None]:
    # A test that fails before an agent's finish() must not leave the process running.
    assert isinstance(asyncio.get_running_loop(), Loop)  # streamfence's own (anyio_backend)
    yield
    for agent in list(RUNNING):
        await agent.kill()


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return PROXY_LOOP  # every connection through streamfence's own accept loop
