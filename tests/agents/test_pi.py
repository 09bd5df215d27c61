"""The pi coding agent (`pi --mode json ...`, @mariozechner/pi-coding-agent run by node) with a
custom OpenAI-compatible provider at the proxy, against the scripted upstream speaking
chat completions.

What it does, learned by running it here and reading its source (docs/agents.md has the
rest): one streaming POST /v1/chat/completions per turn through the openai SDK for Node,
with the key as a Bearer token; no timeout at all while a body streams (its cli.js turns
undici's off), so it never gives up on a stalled stream by itself. It asks again (2 s, 4 s,
8 s later) only when an error's message matches its list of transient faults
(AgentSession._isRetryableError): "timeout", "terminated", "connection lost", 5xx, ...
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.errors import superseded_message
from tests.agents.harness import (
    FAKE_KEY,
    agent_proxy,
    first_of,
    same_turn,
    sse_data,
    streaming,
    supersede_stalled,
)
from tests.agents.pi_agent import PiHome, is_pi_turn, pi_outcome
from tests.scripted import Script, ScriptedUpstream

pytestmark = pytest.mark.agents

PI_HEADERS = {"authorization": f"Bearer {FAKE_KEY}", "content-type": "application/json"}
WORDS = ["Scripted ", "answer ", "from ", "the ", "upstream."]
TEXT = "".join(WORDS)


def _tokens(tag: str) -> list[str]:
    return [f"{tag}-{w}" for w in WORDS]


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


async def test_the_fenced_agent_reports_the_proxys_message_and_does_not_retry(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # pi's stream stalls past healthy_within; the identical request arrives again (another
    # client with the same credential) and supersedes it. pi must show the proxy's message
    # as the turn's error, and must not take it for a transient fault (its retry list
    # matches "terminated", "connection lost", "timeout", ...): no retry, no third request.
    tags = iter(["stalled", "winner", "third"])
    upstream.choose = lambda path, body: Script(tokens=_tokens(next(tags)), gated=True)
    healthy = 2.0
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": healthy}) as proxy:
        agent = await PiHome(tmp_path, proxy.url).agent("Say hello").start()
        first, body, done = await supersede_stalled(
            proxy, upstream, agent, is_pi_turn, PI_HEADERS, healthy
        )
    winner = [e for e in sse_data(body) if e.get("choices")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in winner)
    assert text == "".join(_tokens("winner")) and body.endswith("data: [DONE]\n\n")
    assert len(same_turn(upstream.seen, first)) == 2 and first.closed.is_set()
    assert proxy.watched.sources() == ["upstream", "upstream"]  # pi did not ask again
    outcome = pi_outcome(done)
    assert done.returncode == 0, done  # pi's JSON mode exits 0 and reports the error
    assert outcome.stop == "error" and outcome.retries == []
    assert outcome.error == superseded_message(1, 2)
    assert outcome.text == "".join(_tokens("stalled")[:3])  # what it had, nothing of the winner
