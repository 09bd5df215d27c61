from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.agents.harness import RUNNING


@pytest.fixture(autouse=True)
async def _reap_agents() -> AsyncIterator[None]:
    # A test that fails before an agent's finish() must not leave the process running.
    yield
    for agent in list(RUNNING):
        await agent.kill()
