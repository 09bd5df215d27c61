"""Real client libraries, Python and Node, through the proxy against the scripted upstream
(issue 11 item 6): each scenario with each library's DEFAULT retry settings, asserting what
the library surfaced to its user (text, exception class, message), and how many requests
reached the upstream.

Scenarios (CONTRACT sections 2-4):
- normal: a stream passes through whole.
- stall_retry: the first attempt stalls past healthy_within with its client still
  connected; the same request again (a second client) supersedes it: the first client gets
  a clear error with the proxy's message and nothing after the retry, the second completes.
- twins: identical requests 50 ms apart: both complete whole from one upstream request.
- reflex_retry: the first attempt stalls before its headers and is superseded (a 409 with
  x-should-retry: false); whatever its client then does by default (the openai SDKs obey the
  header, the Vercel AI SDK and litellm's Router retry), the winner completes whole, at
  most 2 upstream requests, and the loser ends with a clear error or the winner's full text.
- turn_id: the same explicit X-Turn-Id with another body supersedes.
- stream_vs_whole: a non-streaming request with the same body as a healthy stream is
  forwarded beside it: both complete, neither is fenced.
- keepalive_stall_retry: stall_retry, the stuck stream sending its provider's keep-alives
  all along (CONTRACT section 3: keep-alives are not content).
- keepalives: a stream with its provider's keep-alives between tokens passes through whole
  (Gemini paths drop comment lines: google-genai fails on them).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.clients.conftest import ALL_CLIENTS, HEALTHY_WITHIN, World
from tests.clients.pyclients import Outcome
from tests.scripted import Script

pytestmark = pytest.mark.clients

SUPERSEDED = "was superseded by attempt 2 of the same turn"
clients = pytest.mark.parametrize("world", ALL_CLIENTS, indirect=True)

# What each library raises (or, the Vercel AI SDK, reports as an `error` part of its
# stream) on the superseded frame mid-stream, each with the proxy's message.
ON_FRAME = {
    "py-openai-chat": "APIError",
    "py-openai-responses": "APIError",
    "py-anthropic": "APIStatusError",  # status 200: the stream's own status
    "py-google-genai": "ClientError",  # status 409, from the frame's error.code
    "py-litellm": "MidStreamFallbackError",
    "py-litellm-router": "APIConnectionError",
    "py-langchain-openai": "APIError",  # openai's, passed through
    "node-openai-chat": "APIError",
    "node-openai-responses": "APIError",
    "node-anthropic": "APIError",
    "node-google-genai": "ApiError",
    "node-ai-sdk-openai-chat": "Object(error part)",
    "node-ai-sdk-openai-responses": "Object(error part)",
    "node-ai-sdk-anthropic": "Object(error part)",
}
# What each raises on the 409 (x-should-retry: false) of an attempt superseded before its
# headers; None: it retries the 409 by default, whatever the header says.
ON_CONFLICT = {
    "py-openai-chat": "ConflictError",
    "py-openai-responses": "ConflictError",
    "py-anthropic": "ConflictError",
    "py-google-genai": "ClientError",
    "py-litellm": "APIError",  # status 409
    "py-litellm-router": None,  # num_retries=2
    "py-langchain-openai": "ConflictError",
    "node-openai-chat": "ConflictError",
    "node-openai-responses": "ConflictError",
    "node-anthropic": "ConflictError",
    "node-google-genai": "ApiError",
    "node-ai-sdk-openai-chat": None,  # maxRetries 2, 409 is retryable to it
    "node-ai-sdk-openai-responses": None,
    "node-ai-sdk-anthropic": None,
}


# The keep-alive each library's provider sends while it works (docs/keepalives.md): Gemini's
# is what intermediaries send (Google's API sends none).
KEEPALIVES = {
    "responses": 'event: keepalive\ndata: {"type":"keepalive","sequence_number":9}\n\n',
    "anthropic": 'event: ping\ndata: {"type": "ping"}\n\n',
    "genai": ": keepalive\n\n",
    "chat": ": OPENROUTER PROCESSING\n\n",
}


def keepalive_for(client: str) -> str:
    return next((v for k, v in KEEPALIVES.items() if k in client), KEEPALIVES["chat"])


def text(prefix: str, n: int) -> str:
    return "".join(f"{prefix}{i} " for i in range(n))


def record(world: World, scenario: str, **outcomes: Outcome) -> None:
    # STREAMFENCE_CLIENTS_LOG=path: what each library surfaced, for docs/clients.md.
    path = os.environ.get("STREAMFENCE_CLIENTS_LOG")
    if path:
        line = {"client": world.client, "scenario": scenario}
        line |= {k: vars(v) for k, v in outcomes.items()}
        line["upstream_requests"] = len(world.upstream.seen)
        with Path(path).open("a") as f:
            f.write(json.dumps(line) + "\n")


def assert_superseded(outcome: Outcome, raised: str | None) -> None:
    """The library surfaced `raised` with the proxy's message: never a silent end."""
    assert outcome.error is not None, f"ended as if complete: {outcome}"
    assert SUPERSEDED in outcome.message, outcome
    assert outcome.error == raised, outcome


def winner_script(world: World) -> Script:
    """The winner of a 409: for a client that retries it, streaming for ~3 s, longer than
    its retry delay (the Vercel AI SDK waits 2 s), so that the retry meets it running."""
    retries = ON_CONFLICT[world.client] is None
    return Script(tokens=10, delay=0.3 if retries else 0.02, prefix="W")


async def first(call_first: asyncio.Event) -> None:
    await asyncio.wait_for(call_first.wait(), 10)


@clients
async def test_normal_stream(world: World) -> None:
    world.upstream.queue.append(Script(tokens=5, prefix="N"))
    outcome = await world.run(world.call())
    record(world, "normal", outcome=outcome)
    assert outcome == Outcome(text=text("N", 5))
    assert len(world.upstream.seen) == 1


@clients
async def test_stall_then_retry_from_a_second_client(world: World) -> None:
    up = world.upstream
    up.queue.extend(
        [Script(tokens=4, gated_after_tokens=1, prefix="A"), Script(tokens=4, prefix="B")]
    )
    a = world.call()
    a_task = world.start(a)
    await first(a.first)
    await asyncio.sleep(HEALTHY_WITHIN + 0.2)  # the stall itself: no upstream byte for so long
    b = await world.run(world.call())
    loser = await asyncio.wait_for(a_task, 10)
    record(world, "stall_retry", loser=loser, winner=b)
    assert b == Outcome(text=text("B", 4))
    assert_superseded(loser, ON_FRAME[world.client])
    assert loser.text == "A0 "  # nothing of attempt 1 after the retry
    assert len(up.seen) == 2
    assert up.seen[0].closed.is_set()  # superseded: closed, not drained


@clients
async def test_stall_behind_keepalives_then_retry_from_a_second_client(world: World) -> None:
    up = world.upstream
    keepalive = keepalive_for(world.client)
    up.queue.extend(
        [
            Script(tokens=4, gated_after_tokens=1, prefix="A", keepalive=keepalive),
            Script(tokens=4, prefix="B"),
        ]
    )
    a = world.call()
    a_task = world.start(a)
    await first(a.first)
    await asyncio.sleep(HEALTHY_WITHIN + 0.2)  # no content for so long, keep-alives all along
    stuck = up.seen[0]
    stuck.pinged.clear()
    await asyncio.wait_for(stuck.pinged.wait(), 5)  # the retry comes right after one
    b = await world.run(world.call())
    loser = await asyncio.wait_for(a_task, 10)
    record(world, "keepalive_stall_retry", loser=loser, winner=b)
    assert b == Outcome(text=text("B", 4))  # a fresh answer, not the stuck one
    assert_superseded(loser, ON_FRAME[world.client])
    assert loser.text == "A0 "
    assert len(up.seen) == 2
    assert stuck.closed.is_set()


@clients
async def test_keepalives_between_tokens_pass_through(world: World) -> None:
    up = world.upstream
    up.queue.append(Script(tokens=5, delay=0.1, prefix="K", keepalive=keepalive_for(world.client)))
    outcome = await world.run(world.call())
    record(world, "keepalives", outcome=outcome)
    assert outcome == Outcome(text=text("K", 5))
    assert up.seen[0].keepalives_sent >= 4 and len(up.seen) == 1


@clients
async def test_identical_twins_50ms_apart_share_one_upstream_request(world: World) -> None:
    up = world.upstream
    up.queue.append(Script(tokens=8, delay=0.1, prefix="T"))
    a_task = world.start(world.call())
    await asyncio.wait_for(up.wait_requests(1), 10)
    await asyncio.sleep(0.05)  # the scenario: the twin 50 ms later
    b_task = world.start(world.call())
    a, b = await asyncio.wait_for(asyncio.gather(a_task, b_task), 20)
    record(world, "twins", a=a, b=b)
    assert a == Outcome(text=text("T", 8))
    assert b == Outcome(text=text("T", 8))
    assert len(up.seen) == 1


@clients
async def test_loser_reflex_retry_never_cuts_the_winner(world: World) -> None:
    up = world.upstream
    up.queue.extend([Script(hold_headers=True), winner_script(world)])
    a_task = world.start(world.call())
    await asyncio.wait_for(up.wait_requests(1), 10)
    await asyncio.sleep(HEALTHY_WITHIN + 0.2)  # attempt 1 stalls before its headers
    winner = await world.run(world.call())
    loser = await asyncio.wait_for(a_task, 30)
    record(world, "reflex_retry", loser=loser, winner=winner)
    assert winner == Outcome(text=text("W", 10))
    assert len(up.seen) <= 2, [s.script for s in up.seen]
    assert up.seen[0].closed.is_set()
    if ON_CONFLICT[world.client] is None:
        assert loser == winner  # its retry followed the winner: the same answer, whole
    else:
        assert_superseded(loser, ON_CONFLICT[world.client])
        assert loser.status == 409
        assert loser.text == ""
        assert len(up.seen) == 2


@clients
async def test_same_turn_id_with_another_body_supersedes(world: World) -> None:
    up = world.upstream
    up.queue.extend(
        [Script(tokens=4, gated_after_tokens=1, prefix="A"), Script(tokens=4, prefix="B")]
    )
    a = world.call(turn="turn-7", prompt="first question")
    a_task = world.start(a)
    await first(a.first)
    b = await world.run(world.call(turn="turn-7", prompt="edited question"))
    loser = await asyncio.wait_for(a_task, 10)
    record(world, "turn_id", loser=loser, winner=b)
    assert b == Outcome(text=text("B", 4))
    assert_superseded(loser, ON_FRAME[world.client])
    assert loser.text == "A0 "
    assert len(up.seen) == 2
    assert all("x-turn-id" not in s.headers for s in up.seen)  # removed before forwarding


@clients
async def test_whole_request_beside_a_healthy_stream_of_the_same_body(world: World) -> None:
    up = world.upstream
    up.queue.extend([Script(tokens=6, delay=0.1, prefix="S"), Script(tokens=3, prefix="J")])
    a = world.call()
    a_task = world.start(a)
    await first(a.first)
    b = await world.run(world.call(stream=False))
    streamed = await asyncio.wait_for(a_task, 10)
    record(world, "stream_vs_whole", stream=streamed, whole=b)
    assert b == Outcome(text=text("J", 3))  # its own JSON answer, never the other's SSE
    assert streamed == Outcome(text=text("S", 6))
    assert len(up.seen) == 2


@pytest.mark.parametrize("world", ALL_CLIENTS, indirect=True)
async def test_stale_retry_under_the_same_turn_id_never_cuts_the_edited_answer(
    world: World,
) -> None:
    """Attempt 1 (turn t, the first question) stalls before its headers; the edited
    question under the same X-Turn-Id supersedes it (409). A client that retries by default
    re-sends the FIRST question: that stale retry must not cut the edited answer (the
    proxy refuses a repeat of a version the running generation replaced)."""
    up = world.upstream
    up.queue.extend([Script(hold_headers=True), winner_script(world)])
    a_task = world.start(world.call(turn="turn-9", prompt="first question"))
    await asyncio.wait_for(up.wait_requests(1), 10)
    winner = await world.run(world.call(turn="turn-9", prompt="edited question"))
    loser = await asyncio.wait_for(a_task, 30)
    record(world, "stale_retry", loser=loser, winner=winner)
    assert winner == Outcome(text=text("W", 10))
    # A clear error, or the turn's (edited) answer whole: never the stale question's answer.
    assert loser == winner or (loser.error is not None and SUPERSEDED in loser.message), loser
    assert len(up.seen) <= 2 + (ON_CONFLICT[world.client] is None) * 2  # its own retries
