"""Claude Code (`claude -p ... --output-format json`, the npm package's native binary)
through the proxy, against the scripted upstream speaking Anthropic Messages.

What it does, learned by running it here (docs/agents.md has the rest): one streaming
POST /v1/messages?beta=true per turn with `-p` and nonessential traffic off; its own stall
timeout (CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS, at least 10 s) ends the stream and re-sends the
body at once without streaming, and so does a mid-stream error event. That re-send caps
max_tokens (128000 -> 64000), so its fingerprint is another turn's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agents.harness import (
    FAKE_KEY,
    ClaudeHome,
    agent_proxy,
    claude_result,
    claude_upstream,
    first_of,
    is_claude_turn,
    same_turn,
    sse_data,
    streaming,
    supersede_stalled,
    superseded_frames,
    wait_for,
)
from tests.scripted import Script, ScriptedUpstream, Seen

pytestmark = pytest.mark.agents

ANTHROPIC_HEADERS = {
    "x-api-key": FAKE_KEY,
    "content-type": "application/json",
    "anthropic-version": "2023-06-01",
}

WORDS = ["Scripted ", "answer ", "from ", "the ", "upstream."]
TEXT = "".join(WORDS)


def _tokens(tag: str) -> list[str]:
    return [f"{tag}-{w}" for w in WORDS]


async def test_a_turn_completes_with_the_scripted_text(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    upstream.choose = claude_upstream(lambda body: Script(tokens=WORDS))
    async with agent_proxy(upstream.url) as proxy:
        done = await ClaudeHome(tmp_path, proxy.url).agent("Say hello").run()
    result = claude_result(done)
    assert done.returncode == 0, done
    assert result["is_error"] is False and result["result"] == TEXT
    turns = [s for s in upstream.seen if is_claude_turn(s)]
    assert len(turns) == 1 and streaming(turns[0]) and turns[0].query == "beta=true"
    assert turns[0].headers["x-api-key"] == FAKE_KEY
    assert turns[0].events_sent == len(WORDS) + 5  # the whole stream went out
    assert proxy.watched.sources() == ["upstream"]


async def test_its_own_stall_retry_replaces_the_stalled_generation(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # The first stream stalls after its first event, past healthy_within (1 s) and up to
    # Claude Code's own byte-idle timeout (10 s, its minimum); Claude then closes it and
    # re-sends the body without streaming, and that second generation answers.
    def turn(body: Any) -> Script:
        if body.get("stream"):
            return Script(tokens=_tokens("first"), gated=True)
        return Script(tokens=_tokens("second"))

    upstream.choose = claude_upstream(turn)
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": 1.0}) as proxy:
        home = ClaudeHome(tmp_path, proxy.url, CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS="10000")
        done = await home.agent("Say hello").run()
    result = claude_result(done)
    assert done.returncode == 0, done
    assert result["is_error"] is False
    assert result["result"] == "".join(_tokens("second"))  # whole, nothing of the first
    first = next(s for s in upstream.seen if is_claude_turn(s))
    assert same_turn(upstream.seen, first) == [first]
    assert [streaming(s) for s in _fallbacks(upstream, first)] == [False]
    assert first.closed.is_set() and first.events_sent == 1
    assert proxy.watched.sources() == ["upstream", "upstream"]


async def test_without_its_fallback_its_stall_retry_supersedes_what_another_client_holds(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # With its non-streaming fallback off, Claude Code re-sends the identical streaming body
    # after its stall timeout. Another client follows its stream, so the stalled generation
    # outlives Claude Code's connection: the re-send must supersede it (stalled longer than
    # healthy_within), not follow it, and the other client gets the superseded frame.
    scripts = iter([("first", True), ("second", False), ("third", False)])

    def turn(body: Any) -> Script:
        tag, held = next(scripts)
        return Script(tokens=_tokens(tag), gated=held)

    upstream.choose = claude_upstream(turn)
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": 1.0}) as proxy:
        home = ClaudeHome(
            tmp_path,
            proxy.url,
            CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS="10000",
            CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK="1",
        )
        agent = await home.agent("Say hello").start()
        first = await wait_for(upstream, is_claude_turn)
        url = f"{first.path}?{first.query}"
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            async with client.stream(
                "POST", url, content=first.body, headers=ANTHROPIC_HEADERS
            ) as held:
                assert held.headers["x-streamfence-source"] == "followed"
                held_body = (await held.aread()).decode()  # ends with the supersede
        done = await agent.finish()
    result = claude_result(done)
    assert done.returncode == 0, done
    assert result["is_error"] is False and result["result"] == "".join(_tokens("second"))
    assert [streaming(s) for s in same_turn(upstream.seen, first)] == [True, True]
    assert first.closed.is_set() and first.events_sent == 1
    assert proxy.watched.sources() == ["upstream", "followed", "upstream"]
    assert [e["type"] for e in sse_data(held_body)] == ["message_start", "error"]
    assert len(superseded_frames(held_body)) == 1


async def test_identical_twins_share_one_upstream_request(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # Two Claude Code processes with one home and session send byte-identical bodies (as
    # its parallel subagents do). The first stream is held until the proxy has answered
    # the second request's headers; both must get the whole answer from one upstream request.
    upstream.choose = claude_upstream(lambda body: Script(tokens=WORDS, gated=True))
    async with agent_proxy(upstream.url) as proxy:
        home = ClaudeHome(tmp_path, proxy.url)
        a = await home.agent("Say hello").start()
        await asyncio.sleep(0.05)  # the scenario: the twin starts 50 ms later
        b = await home.agent("Say hello").start()
        # Neither can finish before the stream is let go: an exit here is a failure to see.
        await first_of(30, "the twin's request", proxy.watched.wait_started(2), a.exit(), b.exit())
        for s in upstream.seen:
            s.release(100)
        done_a, done_b = await a.finish(), await b.finish()
    for done in (done_a, done_b):
        result = claude_result(done)
        assert done.returncode == 0, done
        assert result["is_error"] is False and result["result"] == TEXT
    sent = [e.body for e in proxy.watched.exchanges]
    assert sent[0] == sent[1]  # the twins' requests were byte-identical
    first = next(s for s in upstream.seen if is_claude_turn(s))
    assert len(same_turn(upstream.seen, first)) == 1
    assert _fallbacks(upstream, first) == [] and len(sent) == 2  # nobody fell back
    assert proxy.watched.sources() == ["upstream", "followed"]


async def test_the_fenced_agents_reflex_retry_does_not_cut_the_winner(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # Claude Code's stream stalls past healthy_within; the identical request arrives again
    # (another client with the same credential) and supersedes it. Claude Code answers the
    # superseded frame by re-sending the body without streaming: that must neither fence
    # the winner nor be fenced by it.
    upstream.choose = _stalled_then_winner()
    healthy = 2.0
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": healthy}) as proxy:
        agent = await ClaudeHome(tmp_path, proxy.url).agent("Say hello").start()
        first, body, done = await supersede_stalled(
            proxy, upstream, agent, is_claude_turn, ANTHROPIC_HEADERS, healthy
        )
    result = claude_result(done)
    assert _anthropic_text(body) == ("".join(_tokens("winner")), True)  # the winner, whole
    assert [streaming(s) for s in same_turn(upstream.seen, first)] == [True, True]
    # Claude Code's own fallback went upstream beside the winner and answered it.
    assert [streaming(s) for s in _fallbacks(upstream, first)] == [False]
    assert proxy.watched.sources() == ["upstream", "upstream", "upstream"]
    assert done.returncode == 0, done
    assert result["is_error"] is False
    assert result["result"] == "".join(_tokens("json"))


async def test_without_its_fallback_the_fenced_agent_reports_the_proxys_error(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # The same, with Claude Code's non-streaming fallback off: the superseded stream is the
    # end of its run, and what it reports must be the proxy's message, not a network fault.
    upstream.choose = _stalled_then_winner()
    healthy = 2.0
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": healthy}) as proxy:
        home = ClaudeHome(tmp_path, proxy.url, CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK="1")
        agent = await home.agent("Say hello").start()
        first, body, done = await supersede_stalled(
            proxy, upstream, agent, is_claude_turn, ANTHROPIC_HEADERS, healthy
        )
    result = claude_result(done)
    assert _anthropic_text(body) == ("".join(_tokens("winner")), True)  # the winner, whole
    assert [streaming(s) for s in same_turn(upstream.seen, first)] == [True, True]
    assert _fallbacks(upstream, first) == []
    assert proxy.watched.sources() == ["upstream", "upstream"]
    assert done.returncode == 1, done
    assert result["is_error"] is True and result["api_error_type"] == "stream_superseded"
    message = result["result"]
    assert message.startswith("API Error: streamfence: attempt 1 of this turn was superseded")
    assert "stalled" not in message and "winner" not in message  # no text of either answer


def _stalled_then_winner() -> Callable[[str, Any], Script]:
    """First streaming request: held (the test releases it); second: the winner, held too;
    a non-streaming request (Claude Code's fallback) answers at once."""
    tags = iter(["stalled", "winner", "third", "fourth"])

    def turn(body: Any) -> Script:
        if not body.get("stream"):
            return Script(tokens=_tokens("json"))
        return Script(tokens=_tokens(next(tags)), gated=True)

    return claude_upstream(turn)


def _fallbacks(upstream: ScriptedUpstream, first: Seen) -> list[Seen]:
    """Claude Code's non-streaming re-sends of `first`: the same body but for "stream" and
    "max_tokens" (it caps max_tokens at 64000 without streaming: another fingerprint)."""
    like = same_turn(upstream.seen, first, ignore=("stream", "max_tokens"))
    return [s for s in like if s.body != first.body and not streaming(s)]


def _anthropic_text(sse: str) -> tuple[str, bool]:
    """The text of an Anthropic Messages SSE body, and whether it reached message_stop."""
    text, stopped = "", False
    for block in sse.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                if data.get("type") == "content_block_delta":
                    text += data["delta"].get("text", "")
                if data.get("type") == "message_stop":
                    stopped = True
    return text, stopped
