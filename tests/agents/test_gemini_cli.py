"""Gemini CLI (`gemini -p ... --output-format json`, @google/gemini-cli's bundle run by node)
with an API key and GOOGLE_GEMINI_BASE_URL at the proxy, against the scripted upstream
speaking Gemini's streamGenerateContent.

What it does, learned by running it here and reading its bundle (docs/agents.md has the
rest): one streaming POST /v1beta/models/<model>:streamGenerateContent?alt=sse per turn,
with the key in x-goog-api-key; a stream that ends without a finishReason, or breaks, it
asks again up to 3 more times; an HTTP 409 it does not retry.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.agents.gemini_cli import (
    GeminiHome,
    gemini_requests,
    gemini_result,
    gemini_script,
    is_gemini_turn,
)
from tests.agents.harness import FAKE_KEY, agent_proxy, first_of
from tests.upstream import ScriptedUpstream

pytestmark = pytest.mark.agents

WORDS = ["Scripted ", "answer ", "from ", "the ", "upstream."]
TEXT = "".join(WORDS)


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
