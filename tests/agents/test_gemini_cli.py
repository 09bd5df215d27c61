"""Gemini CLI (`gemini -p ... --output-format json`, @google/gemini-cli's bundle run by node)
with an API key and GOOGLE_GEMINI_BASE_URL at the proxy, against the scripted upstream
speaking Gemini's streamGenerateContent.

What it does, learned by running it here and reading its bundle (docs/agents.md has the
rest): one streaming POST /v1beta/models/<model>:streamGenerateContent?alt=sse per turn,
with the key in x-goog-api-key; a stream that ends without a finishReason, or breaks, it
asks again 1 s later (then 2 s, 4 s: 4 attempts), with the same body; an HTTP 409 it does
not retry. Its bundled @google/genai does not recognise the proxy's superseded frame as an
error: it reads it as a chunk without candidates, and the stream then ends without a
finishReason, which is what makes Gemini CLI ask again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.agents.gemini_cli import (
    GeminiHome,
    gemini_requests,
    gemini_result,
    gemini_script,
    is_gemini_turn,
)
from tests.agents.harness import (
    FAKE_KEY,
    agent_proxy,
    first_of,
    same_turn,
    sse_data,
    supersede_stalled,
)
from tests.scripted import ScriptedUpstream

pytestmark = pytest.mark.agents

GEMINI_HEADERS = {"x-goog-api-key": FAKE_KEY, "content-type": "application/json"}
WORDS = ["Scripted ", "answer ", "from ", "the ", "upstream."]
TEXT = "".join(WORDS)


def _tokens(tag: str) -> list[str]:
    return [f"{tag}-{w}" for w in WORDS]


async def test_a_turn_completes_with_the_scripted_text(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    upstream.choose = lambda path, body: gemini_script(WORDS)
    async with agent_proxy(upstream.url) as proxy:
        done = await GeminiHome(tmp_path, proxy.url).agent("Say hello").run()
    result = gemini_result(done)
    assert done.returncode == 0, done
    assert result["response"] == TEXT and "error" not in result
    assert gemini_requests(result)["totalRequests"] == 1
    turns = [s for s in upstream.seen if is_gemini_turn(s)]
    assert len(turns) == 1 and turns[0].query == "alt=sse"
    assert turns[0].headers["x-goog-api-key"] == FAKE_KEY
    assert turns[0].events_sent == len(WORDS) + 1  # the whole stream went out
    assert len(upstream.seen) == 1 and proxy.watched.sources() == ["upstream"]


async def test_identical_twins_share_one_upstream_request(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # Two Gemini CLI processes with one home and working directory send byte-identical
    # bodies (two sessions asking the same question at once). The first stream is held
    # after its first chunk until the proxy has answered the second request's headers:
    # both must get the whole answer from one upstream request.
    upstream.choose = lambda path, body: gemini_script(WORDS, gated=True)
    # The twin is judged healthy however long the machine takes to start the second one.
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": 60.0}) as proxy:
        home = GeminiHome(tmp_path, proxy.url)
        a = await home.agent("Say hello").start()
        await asyncio.sleep(0.05)  # the scenario: the twin starts 50 ms later
        b = await home.agent("Say hello").start()
        # Neither can finish before the stream is let go: an exit here is a failure to see.
        await first_of(30, "the twin's request", proxy.watched.wait_started(2), a.exit(), b.exit())
        for s in upstream.seen:
            s.release(100)
        done_a, done_b = await a.finish(), await b.finish()
    for done in (done_a, done_b):
        result = gemini_result(done)
        assert done.returncode == 0, done
        assert result["response"] == TEXT and gemini_requests(result)["totalErrors"] == 0
    sent = [e.body for e in proxy.watched.exchanges]
    assert len(sent) == 2 and sent[0] == sent[1]  # byte-identical, and nobody asked again
    assert len(upstream.seen) == 1 and upstream.seen[0].events_sent == len(WORDS) + 1
    assert proxy.watched.sources() == ["upstream", "followed"]


async def test_the_fenced_agents_retry_follows_the_winner(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # Gemini CLI's stream stalls past healthy_within; the identical request arrives again
    # (another client with the same credential) and supersedes it. Gemini CLI takes the
    # superseded frame for a stream without a finishReason and asks again 1 s later, with
    # the same body: that retry must follow the winner, not fence it.
    tags = iter(["stalled", "winner", "third", "fourth", "fifth"])
    upstream.choose = lambda path, body: gemini_script(_tokens(next(tags)), gated=True)
    healthy = 3.0  # above its 1 s retry delay, with room for a loaded machine
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": healthy}) as proxy:
        agent = await GeminiHome(tmp_path, proxy.url).agent("Say hello").start()
        first, body, done = await supersede_stalled(
            proxy, upstream, agent, is_gemini_turn, GEMINI_HEADERS, healthy
        )
    assert _gemini_text(body) == ("".join(_tokens("winner")), True)  # the winner, whole
    assert len(same_turn(upstream.seen, first)) == 2  # 2 generations, no third
    assert first.closed.is_set() and first.events_sent == 3
    assert proxy.watched.sources() == ["upstream", "upstream", "followed"]
    result = gemini_result(done)
    assert done.returncode == 0, done
    assert gemini_requests(result)["totalRequests"] == 2
    # What it prints keeps the text of the attempt it gave up on before the answer of the
    # retry (it does so after any retry mid-stream, with or without the proxy; the model's
    # history holds the retry's answer alone).
    assert result["response"] == "".join(_tokens("stalled")[:3] + _tokens("winner"))


def _gemini_text(sse: str) -> tuple[str, bool]:
    """The text of a Gemini SSE body, and whether it reached a finishReason."""
    text, finished = "", False
    for event in sse_data(sse):
        for candidate in event.get("candidates", []):
            parts: list[dict[str, Any]] = candidate.get("content", {}).get("parts", [])
            text += "".join(p.get("text", "") for p in parts)
            finished = finished or bool(candidate.get("finishReason"))
    return text, finished
