"""Codex CLI with its WebSocket transport (`supports_websockets = true` on a custom provider)
through the proxy, against the scripted Responses WebSocket upstream. Codex is the npm
package under tests/agents (installed by that suite's package-lock); these tests skip when
it is absent.

What Codex 0.171 does here, learned by running it: one socket to /v1/responses with
`OpenAI-Beta: responses_websockets=2026-02-06`; a prewarm `response.create` with
`generate: false`, then the turn's `response.create` with the whole input. A response that
goes quiet for stream_idle_timeout_ms: Codex closes that socket and sends the same request
on a new one (no prewarm).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from proxy.ops.record import Record
from tests.conftest import Proxy, ProxyFactory
from tests.ws_upstream import WsUpstream, ws_upstream

ROOT = Path(__file__).resolve().parents[2]
CODEX = Path(os.environ.get("STREAMFENCE_CODEX", ROOT / "tests/agents/node_modules/.bin/codex"))
pytestmark = [
    pytest.mark.agents,
    pytest.mark.skipif(not CODEX.exists(), reason=f"Codex CLI not installed at {CODEX}"),
]
KEY = "sk-streamfence-test"


@pytest.fixture
async def wsup() -> AsyncIterator[WsUpstream]:
    async with ws_upstream() as upstream:
        yield upstream


def records(proxy: Proxy) -> list[Record]:
    seen: list[Record] = []
    finished = proxy.runtime.finished

    def keep(record: Record, error: Any) -> None:
        seen.append(record)
        finished(record, error)

    proxy.runtime.finished = keep  # type: ignore[method-assign]
    return seen


async def codex(tmp: Path, proxy: Proxy, prompt: str, **provider: Any) -> dict[str, Any]:
    home, codex_home, work = tmp / "home", tmp / "codex", tmp / "work"
    for d in (home, codex_home, work):
        d.mkdir(parents=True, exist_ok=True)
    settings = {
        "name": "streamfence",
        "base_url": f"{proxy.url}/v1",
        "wire_api": "responses",
        "env_key": "STREAMFENCE_TEST_KEY",
        "supports_websockets": True,
        **provider,
    }
    lines = ['model = "test-model"', 'model_provider = "streamfence"']
    lines += ["check_for_update_on_startup = false", "", "[model_providers.streamfence]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    (codex_home / "config.toml").write_text("\n".join(lines) + "\n")
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "CODEX_HOME": str(codex_home),
        "STREAMFENCE_TEST_KEY": KEY,
        "NO_PROXY": "127.0.0.1",
    }
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        str(CODEX),
        "exec",
        "--skip-git-repo-check",
        "--json",
        prompt,
        cwd=work,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    events = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    texts = [
        e["item"]["text"]
        for e in events
        if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
    ]
    return {
        "rc": process.returncode,
        "text": texts[-1] if texts else "",
        "completed": any(e.get("type") == "turn.completed" for e in events),
        "seconds": time.monotonic() - started,
        "stderr": err.decode()[-2000:],
    }


def prewarm(request: dict[str, Any]) -> bool:
    return request.get("generate") is False


async def test_a_codex_turn_runs_over_websocket_without_falling_back(
    tmp_path: Path, wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    words = ["Hello ", "over ", "a ", "socket."]
    wsup.choose = lambda request: {"tokens": [] if prewarm(request) else words}
    async with make_proxy(wsup.url) as proxy:
        seen = records(proxy)
        done = await codex(tmp_path, proxy, "Say hello")
        await proxy.runtime.wait_idle()
    assert done["rc"] == 0, done
    assert done["text"] == "".join(words) and done["completed"]
    assert len(wsup.conns) == 1  # one socket, no reconnect
    conn = wsup.conns[0]
    assert conn.headers["Authorization"] == f"Bearer {KEY}"
    assert conn.headers["OpenAI-Beta"].startswith("responses_websockets=")
    assert [r.method for r in seen] == ["WS"] * len(seen)  # no HTTP fallback request
    assert {r.outcome for r in seen} == {"completed"}


async def test_codex_stall_retry_over_websocket_replaces_the_stalled_response(
    tmp_path: Path, wsup: WsUpstream, make_proxy: ProxyFactory
) -> None:
    turns = iter([{"gated": True, "tokens": ["stalled"]}, {"tokens": ["second ", "answer"]}])
    wsup.choose = lambda request: {"tokens": []} if prewarm(request) else next(turns)
    async with make_proxy(wsup.url, **{"upstream.healthy_within": 1.0}) as proxy:
        seen = records(proxy)
        done = await codex(
            tmp_path, proxy, "Say hello", stream_idle_timeout_ms=2000, stream_max_retries=2
        )
        await proxy.runtime.wait_idle()
        assert proxy.runtime.registry.live_keys() == 0
    assert done["rc"] == 0, done
    assert done["text"] == "second answer" and done["completed"]
    real = [g for g in wsup.gens if not prewarm(g.request)]
    assert len(real) == 2
    assert real[0].cut and not real[0].finished  # the stalled generation was stopped upstream
    assert real[1].finished
    # Codex closes a stalled socket and sends the same request on a new one: the stalled
    # response ends as its client's leaving (nothing left to fence), the retry completes.
    assert len(wsup.conns) == 2
    assert sorted(r.outcome for r in seen) == ["client_gone", "completed", "completed"]
