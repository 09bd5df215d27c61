"""The pi coding agent (`pi --mode json ...`, @mariozechner/pi-coding-agent run by node) with a
custom OpenAI-compatible provider at the proxy, against the scripted upstream speaking
chat completions.

What it does, learned by running it here and reading its source (docs/agents.md has the
rest): one streaming POST /v1/chat/completions per turn through the openai SDK for Node,
with the key as a Bearer token; no timeout at all while a body streams (its cli.js turns
undici's off), so it never gives up on a stalled stream by itself.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.agents.harness import FAKE_KEY, agent_proxy, first_of, streaming
from tests.agents.pi_agent import PiHome, is_pi_turn, pi_outcome
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.agents

WORDS = ["Scripted ", "answer ", "from ", "the ", "upstream."]
TEXT = "".join(WORDS)


async def test_a_turn_completes_with_the_scripted_text(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    upstream.choose = lambda path, body: Script(tokens=WORDS)
    async with agent_proxy(upstream.url) as proxy:
        done = await PiHome(tmp_path, proxy.url).agent("Say hello").run()
    outcome = pi_outcome(done)
    assert done.returncode == 0, done
    assert outcome.text == TEXT and outcome.stop == "stop" and outcome.retries == []
    turns = [s for s in upstream.seen if is_pi_turn(s)]
    assert len(turns) == 1 and streaming(turns[0])
    assert turns[0].headers["authorization"] == f"Bearer {FAKE_KEY}"
    assert turns[0].events_sent == len(WORDS) + 2  # the whole stream went out, [DONE] too
    assert len(upstream.seen) == 1 and proxy.watched.sources() == ["upstream"]


async def test_identical_twins_share_one_upstream_request(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # Two pi processes with one home and working directory send byte-identical bodies (two
    # sessions asking the same question at once). The first stream is held after its first
    # chunk until the proxy has answered the second request's headers: both must get the
    # whole answer from one upstream request.
    upstream.choose = lambda path, body: Script(tokens=WORDS, gated=True)
    # The twin is judged healthy however long the machine takes to start the second one.
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": 60.0}) as proxy:
        home = PiHome(tmp_path, proxy.url)
        a = await home.agent("Say hello").start()
        await asyncio.sleep(0.05)  # the scenario: the twin starts 50 ms later
        b = await home.agent("Say hello").start()
        # Neither can finish before the stream is let go: an exit here is a failure to see.
        await first_of(30, "the twin's request", proxy.watched.wait_started(2), a.exit(), b.exit())
        for s in upstream.seen:
            s.release(100)
        done_a, done_b = await a.finish(), await b.finish()
    for done in (done_a, done_b):
        outcome = pi_outcome(done)
        assert done.returncode == 0, done
        assert outcome.text == TEXT and outcome.stop == "stop" and outcome.retries == []
    sent = [e.body for e in proxy.watched.exchanges]
    assert len(sent) == 2 and sent[0] == sent[1]  # byte-identical, and nobody asked again
    assert len(upstream.seen) == 1 and upstream.seen[0].events_sent == len(WORDS) + 2
    assert proxy.watched.sources() == ["upstream", "followed"]
