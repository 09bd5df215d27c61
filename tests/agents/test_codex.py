"""Codex CLI (`codex exec --skip-git-repo-check --json`, the npm package's native binary)
with a custom model provider at the proxy (`wire_api = "responses"`), against the scripted
upstream speaking the Responses API.

What it does, learned by running it here (docs/agents.md has the rest): one streaming POST
/v1/responses per turn; a stream that goes quiet for `stream_idle_timeout_ms`, or that ends
before response.completed (the proxy's superseded frame included: Codex does not read the
error event), it closes and re-sends ~200 ms later, up to `stream_max_retries` times, with
the same body (same JSON, keys possibly in another order). Two Codex processes never send
identical bodies: each carries its own session, turn and message ids.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.agents.harness import (
    FAKE_KEY,
    CodexHome,
    agent_proxy,
    codex_outcome,
    codex_script,
    is_codex_turn,
    same_turn,
    sse_data,
    supersede_stalled,
    superseded_frames,
    wait_for,
)
from tests.scripted import ScriptedUpstream

pytestmark = pytest.mark.agents

CODEX_HEADERS = {"authorization": f"Bearer {FAKE_KEY}", "content-type": "application/json"}
WORDS = ["Scripted ", "answer ", "from ", "the ", "upstream."]
TEXT = "".join(WORDS)


def _tokens(tag: str) -> list[str]:
    return [f"{tag}-{w}" for w in WORDS]


async def test_a_turn_completes_with_the_scripted_text(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    upstream.choose = lambda path, body: codex_script(WORDS)
    async with agent_proxy(upstream.url) as proxy:
        done = await CodexHome(tmp_path, proxy.url).agent("Say hello").run()
    outcome = codex_outcome(done)
    assert done.returncode == 0, done
    assert outcome.text == TEXT and outcome.completed and outcome.errors == []
    turns = [s for s in upstream.seen if is_codex_turn(s)]
    assert len(turns) == 1 and turns[0].json["stream"] is True
    assert turns[0].headers["authorization"] == f"Bearer {FAKE_KEY}"
    assert turns[0].events_sent == len(WORDS) + 4  # the whole stream went out
    assert proxy.watched.sources() == ["upstream"]


async def test_its_own_stall_retry_replaces_the_stalled_generation(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # The first stream stalls after response.created, past healthy_within (1 s) and up to
    # Codex's stream_idle_timeout_ms (2 s); Codex closes it and re-sends the same body, and
    # that second generation must answer whole.
    scripts = iter([_tokens("first"), _tokens("second")])
    upstream.choose = lambda path, body: codex_script(next(scripts), gated=True)
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": 1.0}) as proxy:
        home = CodexHome(tmp_path, proxy.url, stream_idle_timeout_ms=2000, stream_max_retries=2)
        agent = await home.agent("Say hello").start()
        await proxy.watched.wait_started(2)
        upstream.seen[1].release(100)
        done = await agent.finish()
    outcome = codex_outcome(done)
    assert done.returncode == 0, done
    assert outcome.text == "".join(_tokens("second")) and outcome.completed
    assert len(outcome.errors) == 1 and outcome.errors[0].startswith("Reconnecting... 1/2")
    assert "idle timeout" in outcome.errors[0]
    first = upstream.seen[0]
    assert len(same_turn(upstream.seen, first)) == 2  # 2 upstream generations
    assert first.closed.is_set() and first.events_sent == 1
    assert proxy.watched.sources() == ["upstream", "upstream"]


async def test_its_stall_retry_supersedes_the_generation_another_client_holds(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # Another client follows Codex's stream, so the stalled generation outlives Codex's own
    # connection. Codex's retry (after its 2 s idle timeout) finds it stalled for longer than
    # healthy_within (1 s): it must start a new generation, not follow the stalled one, and
    # the other client must get the superseded frame.
    scripts = iter([_tokens("first"), _tokens("second"), _tokens("third")])
    upstream.choose = lambda path, body: codex_script(next(scripts), gated=True)
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": 1.0}) as proxy:
        home = CodexHome(tmp_path, proxy.url, stream_idle_timeout_ms=2000, stream_max_retries=2)
        agent = await home.agent("Say hello").start()
        first = await wait_for(upstream, is_codex_turn)
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            async with client.stream(
                "POST", first.path, content=first.body, headers=CODEX_HEADERS
            ) as held:
                assert held.headers["x-streamfence-source"] == "followed"
                await proxy.watched.wait_started(3)  # Codex's retry
                for s in upstream.seen[1:]:  # never the stalled one
                    s.release(100)
                held_body = (await held.aread()).decode()
        done = await agent.finish()
    outcome = codex_outcome(done)
    assert done.returncode == 0, done
    assert outcome.text == "".join(_tokens("second")) and outcome.completed
    assert len(outcome.errors) == 1 and "idle timeout" in outcome.errors[0]
    assert len(same_turn(upstream.seen, first)) == 2 and first.closed.is_set()
    assert proxy.watched.sources() == ["upstream", "followed", "upstream"]
    # The other client: the stalled generation's first event, then the frame; no success.
    assert [e["type"] for e in sse_data(held_body)] == ["response.created", "error"]
    assert len(superseded_frames(held_body)) == 1


async def test_two_sessions_at_once_both_complete(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # Two Codex sessions asking the same question 50 ms apart. Their bodies differ (session,
    # turn and message ids), so neither can be served from the other: each must get its own
    # whole answer, and neither may be fenced. Both streams are held until both requests
    # are upstream, so that the two are in flight together.
    tags = iter(["one", "two"])
    upstream.choose = lambda path, body: codex_script(_tokens(next(tags)), gated=True)
    async with agent_proxy(upstream.url) as proxy:
        a = await CodexHome(tmp_path / "a", proxy.url).agent("Say hello").start()
        await asyncio.sleep(0.05)  # the scenario: the twin starts 50 ms later
        b = await CodexHome(tmp_path / "b", proxy.url).agent("Say hello").start()
        seen = await asyncio.wait_for(upstream.wait_requests(2), 30)
        for s in seen:
            s.release(100)
        done_a, done_b = await a.finish(), await b.finish()
    texts = set()
    for done in (done_a, done_b):
        outcome = codex_outcome(done)
        assert done.returncode == 0, done
        assert outcome.completed and outcome.errors == []
        texts.add(outcome.text)
    assert texts == {"".join(_tokens("one")), "".join(_tokens("two"))}
    assert len([s for s in upstream.seen if is_codex_turn(s)]) == 2
    assert not any(s.closed.is_set() for s in upstream.seen)
    assert proxy.watched.sources() == ["upstream", "upstream"]


async def test_the_fenced_agents_reflex_retry_does_not_cut_the_winner(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # Codex's stream stalls past healthy_within; the identical request arrives again
    # (another client with the same credential) and supersedes it. Codex, with its default
    # retry settings, answers the superseded frame by re-sending the same body: that retry
    # must follow the winner, not fence it.
    tags = iter(["stalled", "winner", "third", "fourth", "fifth", "sixth", "seventh"])
    upstream.choose = lambda path, body: codex_script(_tokens(next(tags)), gated=True)
    healthy = 2.0
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": healthy}) as proxy:
        agent = await CodexHome(tmp_path, proxy.url).agent("Say hello").start()
        first, body, done = await supersede_stalled(
            proxy, upstream, agent, is_codex_turn, CODEX_HEADERS, healthy
        )
    outcome = codex_outcome(done)
    assert _responses_text(body) == ("".join(_tokens("winner")), True)  # the winner, whole
    assert len(same_turn(upstream.seen, first)) == 2  # 2 generations, no third
    assert proxy.watched.sources() == ["upstream", "upstream", "followed"]
    assert done.returncode == 0, done
    assert outcome.completed and outcome.text == "".join(_tokens("winner"))
    assert len(outcome.errors) == 1 and outcome.errors[0].startswith("Reconnecting... 1/5")


def _responses_text(sse: str) -> tuple[str, bool]:
    """The text deltas of a Responses SSE body, and whether it reached response.completed."""
    text, completed = "", False
    for block in sse.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                if data.get("type") == "response.output_text.delta":
                    text += data["delta"]
                completed = completed or data.get("type") == "response.completed"
    return text, completed
