"""aider (`aider --message ...`, aider-chat in its own environment, .venv-aider) with an
OpenAI-compatible model at the proxy (`--openai-api-base`), against the scripted upstream
speaking chat completions.

What it does, learned by running it here and reading its source (docs/agents.md has the
rest): one streaming POST /v1/chat/completions per message through litellm and the openai
SDK for Python, with the key as a Bearer token. It retries whatever it is told, with the same
body: a socket read timeout (`--timeout`), the proxy's superseded frame and an HTTP 409 all
become litellm exceptions that aider retries 0.25 s later (then 0.5 s, 1 s, ... while the
delay stays under 60 s: Coder.send_message).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.errors import superseded_message
from tests.agents.aider_chat import AiderHome, aider_reply, is_aider_turn
from tests.agents.harness import (
    FAKE_KEY,
    agent_proxy,
    first_of,
    same_turn,
    sse_data,
    streaming,
    supersede_stalled,
    wait_for,
)
from tests.scripted import Script, ScriptedUpstream

pytestmark = pytest.mark.agents

AIDER_HEADERS = {"authorization": f"Bearer {FAKE_KEY}", "content-type": "application/json"}
WORDS = ["Scripted ", "answer ", "from ", "the ", "upstream."]
TEXT = "".join(WORDS)


def _tokens(tag: str) -> list[str]:
    return [f"{tag}-{w}" for w in WORDS]


async def test_a_turn_completes_with_the_scripted_text(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    upstream.choose = lambda path, body: Script(tokens=WORDS)
    async with agent_proxy(upstream.url) as proxy:
        done = await AiderHome(tmp_path, proxy.url).agent("Say hello").run()
    assert done.returncode == 0, done
    assert aider_reply(done) == TEXT
    turns = [s for s in upstream.seen if is_aider_turn(s)]
    assert len(turns) == 1 and streaming(turns[0])
    assert turns[0].headers["authorization"] == f"Bearer {FAKE_KEY}"
    assert turns[0].events_sent == len(WORDS) + 2  # the whole stream went out, [DONE] too
    assert len(upstream.seen) == 1 and proxy.watched.sources() == ["upstream"]


async def test_identical_twins_share_one_upstream_request(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # Two aider processes in one working directory send byte-identical bodies (two sessions
    # asking the same question at once). The first stream is held after its first chunk
    # until the proxy has answered the second request's headers: both must get the whole
    # answer from one upstream request.
    upstream.choose = lambda path, body: Script(tokens=WORDS, gated=True)
    # The twin is judged healthy however long the machine takes to start the second one.
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": 60.0}) as proxy:
        home = AiderHome(tmp_path, proxy.url)
        a = await home.agent("Say hello").start()
        await asyncio.sleep(0.05)  # the scenario: the twin starts 50 ms later
        b = await home.agent("Say hello").start()
        # Neither can finish before the stream is let go: an exit here is a failure to see.
        await first_of(60, "the twin's request", proxy.watched.wait_started(2), a.exit(), b.exit())
        for s in upstream.seen:
            s.release(100)
        done_a, done_b = await a.finish(), await b.finish()
    for done in (done_a, done_b):
        assert done.returncode == 0, done
        assert aider_reply(done) == TEXT
    sent = [e.body for e in proxy.watched.exchanges]
    assert len(sent) == 2 and sent[0] == sent[1]  # byte-identical, and nobody asked again
    assert len(upstream.seen) == 1 and upstream.seen[0].events_sent == len(WORDS) + 2
    assert proxy.watched.sources() == ["upstream", "followed"]


async def test_its_stall_retry_supersedes_the_generation_another_client_holds(
    tmp_path: Path, upstream: ScriptedUpstream
) -> None:
    # Another client follows aider's stream, so the stalled generation outlives aider's own
    # connection. aider's retry (after its 3 s read timeout) finds it stalled for longer
    # than healthy_within (1.5 s): it must start a new generation, not follow the stalled
    # one, and the other client must be told it was superseded.
    tags = iter(["first", "second", "third"])
    upstream.choose = lambda path, body: Script(tokens=_tokens(next(tags)), gated=True)
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": 1.5}) as proxy:
        home = AiderHome(tmp_path, proxy.url, args=["--timeout", "3"])
        agent = await home.agent("Say hello").start()
        first = await wait_for(upstream, is_aider_turn, 60)
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            async with client.stream(
                "POST", first.path, content=first.body, headers=AIDER_HEADERS
            ) as held:
                assert held.headers["x-streamfence-source"] == "followed"
                await proxy.watched.wait_started(3)  # aider's retry
                for s in upstream.seen[1:]:  # never the stalled one
                    s.release(100)
                held_body = (await held.aread()).decode()
        done = await agent.finish()
    assert done.returncode == 0, done
    reply = aider_reply(done)
    assert "timed out" in reply and reply.endswith("".join(_tokens("second")))
    assert len(same_turn(upstream.seen, first)) == 2 and first.closed.is_set()
    assert proxy.watched.sources() == ["upstream", "followed", "upstream"]
    # The other client: the stalled generation's first chunk, then the frame; no [DONE].
    assert [_chat_kind(e) for e in sse_data(held_body)] == ["chunk", "error"]
    assert "[DONE]" not in held_body


@pytest.mark.parametrize("before_headers", [False, True], ids=["mid-stream", "409"])
async def test_the_fenced_agents_retry_follows_the_winner(
    tmp_path: Path, upstream: ScriptedUpstream, before_headers: bool
) -> None:
    # aider's request stalls past healthy_within (mid-stream, or before its response
    # headers); the identical request arrives again (another client with the same
    # credential) and supersedes it. aider retries the superseded frame, and the 409 too
    # (x-should-retry: false stops the openai SDK, not aider's own loop), 0.25 s later with
    # the same body: that retry must follow the winner, not fence it.
    tags = iter(["stalled", "winner", "third", "fourth"])

    def turn(path: str, body: Any) -> Script:
        tag = next(tags)
        held = before_headers and tag == "stalled"
        return Script(tokens=_tokens(tag), gated=not held, hold_headers=held)

    upstream.choose = turn
    healthy = 2.0
    async with agent_proxy(upstream.url, **{"upstream.healthy_within": healthy}) as proxy:
        agent = await AiderHome(tmp_path, proxy.url).agent("Say hello").start()
        first, body, done = await supersede_stalled(
            proxy, upstream, agent, is_aider_turn, AIDER_HEADERS, healthy, before_headers
        )
    winner = [e for e in sse_data(body) if e.get("choices")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in winner)
    assert text == "".join(_tokens("winner")) and body.endswith("data: [DONE]\n\n")
    assert len(same_turn(upstream.seen, first)) == 2  # 2 generations, no third
    assert first.closed.is_set()
    assert proxy.watched.sources() == ["upstream", "upstream", "followed"]
    assert done.returncode == 0, done
    reply = " ".join(aider_reply(done).split())  # it wraps long lines
    assert superseded_message(1, 2) in reply and "Retrying in 0.2 seconds..." in reply
    assert reply.endswith("".join(_tokens("winner")))


def _chat_kind(event: dict[str, Any]) -> str:
    return "chunk" if "choices" in event else "error" if "error" in event else "?"
