"""A stream that stalls behind keep-alives is stalled (CONTRACT section 3; issue 27 item 1).

The upstream sends a token, then only keep-alives: OpenRouter's `: OPENROUTER PROCESSING`
comments, Anthropic's `event: ping`, sse-starlette's `: ping - <date>` (CRLF lines), OpenAI's
Responses `keepalive` event. The agent's retry of that stream, past `healthy_within`, must get
a fresh answer through the official SDK at once: the stuck upstream closed at the retry, the
stuck client told it was superseded. Health counted from any upstream byte made the retry
follow the stuck stream instead (worse than no proxy). A healthy stream that sends keep-alives
between its tokens is still followed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest

from proxy.wire import health
from tests.conftest import ProxyFactory
from tests.scripted import Script, ScriptedUpstream
from tests.sse_client import chat_body, events

HEALTHY_WITHIN = 0.5
CHAT = "/v1/chat/completions"
BODY = chat_body()
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
OPENROUTER = ": OPENROUTER PROCESSING\n\n"
ANTHROPIC_PING = 'event: ping\ndata: {"type": "ping"}\n\n'
SSE_STARLETTE = ": ping - 2025-06-01 12:00:00.000000\r\n\r\n"  # its default, CRLF lines
OPENAI_KEEPALIVE = 'event: keepalive\ndata: {"type":"keepalive","sequence_number":3}\n\n'

Pieces = Callable[[str], AsyncIterator[str]]


@dataclass
class Sdk:
    """One official SDK streaming one request; `pieces(base)` yields the text."""

    name: str
    pieces: Pieces
    raises: type[Exception]


def openai_chat(base: str) -> AsyncIterator[str]:
    async def run() -> AsyncIterator[str]:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-t", max_retries=0) as c:
            stream = await c.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            async for chunk in stream:
                for choice in chunk.choices:
                    yield choice.delta.content or ""

    return run()


def openai_responses(base: str) -> AsyncIterator[str]:
    async def run() -> AsyncIterator[str]:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-t", max_retries=0) as c:
            stream = await c.responses.create(model="m", input="hi", stream=True)
            async for event in stream:
                if event.type == "response.output_text.delta":
                    yield event.delta

    return run()


def anthropic_messages(base: str) -> AsyncIterator[str]:
    async def run() -> AsyncIterator[str]:
        client = anthropic.AsyncAnthropic(base_url=base, api_key="sk-ant-t", max_retries=0)
        async with client:
            stream = await client.messages.create(
                model="m", max_tokens=10, messages=MESSAGES, stream=True
            )
            async for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    yield event.delta.text

    return run()


OPENAI_CHAT = Sdk("openai-chat", openai_chat, openai.APIError)
OPENAI_RESPONSES = Sdk("openai-responses", openai_responses, openai.APIError)
ANTHROPIC = Sdk("anthropic", anthropic_messages, anthropic.APIError)

STALLS = [
    pytest.param(OPENAI_CHAT, OPENROUTER, id="openrouter-comments"),
    pytest.param(ANTHROPIC, ANTHROPIC_PING, id="anthropic-pings"),
    pytest.param(OPENAI_CHAT, SSE_STARLETTE, id="sse-starlette-pings"),
    pytest.param(OPENAI_RESPONSES, OPENAI_KEEPALIVE, id="openai-keepalive-events"),
]


async def collect(pieces: AsyncIterator[str], got: list[str], first: asyncio.Event) -> None:
    async for piece in pieces:
        if piece:
            got.append(piece)
            first.set()


@pytest.mark.parametrize(("sdk", "keepalive"), STALLS)
async def test_a_retry_of_a_stream_stalled_behind_keepalives_gets_a_fresh_answer(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, sdk: Sdk, keepalive: str
) -> None:
    stuck = Script(tokens=4, gated_after_tokens=1, prefix="A", keepalive=keepalive)
    upstream.queue.extend([stuck, Script(tokens=4, prefix="B")])
    overrides = {"upstream.healthy_within": HEALTHY_WITHIN}
    async with make_proxy(upstream.url, **overrides) as proxy:
        a_text: list[str] = []
        a_first = asyncio.Event()
        a_task = asyncio.create_task(collect(sdk.pieces(proxy.url), a_text, a_first))
        await asyncio.wait_for(a_first.wait(), 10)
        (a_seen,) = upstream.seen
        # The stall: past healthy_within, the upstream sending keep-alives all along; the
        # retry comes right after one of them (by any byte, the stream looks alive).
        await asyncio.sleep(HEALTHY_WITHIN + 0.2)
        a_seen.pinged.clear()
        await asyncio.wait_for(a_seen.pinged.wait(), 5)
        assert a_seen.keepalives_sent >= 2 and not a_seen.closed.is_set()
        b_text: list[str] = []
        # The agent's retry, the same request: a fresh answer at once, not the stuck one.
        await asyncio.wait_for(collect(sdk.pieces(proxy.url), b_text, asyncio.Event()), 5)
        assert "".join(b_text) == "B0 B1 B2 B3 "
        assert len(upstream.seen) == 2
        await asyncio.wait_for(a_seen.closed.wait(), 5)  # the stuck upstream is closed
        with pytest.raises(sdk.raises, match="superseded"):  # its client is told why
            await asyncio.wait_for(a_task, 5)
        assert a_text == ["A0 "]
        await asyncio.wait_for(proxy.runtime.wait_idle(), 10)


@pytest.mark.parametrize(
    ("sdk", "keepalive"),
    [
        pytest.param(OPENAI_CHAT, OPENROUTER, id="openrouter-comments"),
        pytest.param(ANTHROPIC, ANTHROPIC_PING, id="anthropic-pings"),
    ],
)
async def test_a_healthy_stream_with_keepalives_between_its_tokens_is_still_followed(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, sdk: Sdk, keepalive: str
) -> None:
    """No false stall: a token every 0.3 s (a keep-alive halfway between two) keeps the
    stream healthy under a 1 s window, so the twin 1.3 s later follows it: one upstream
    request, both answers whole. (Guards the other way round: content taken for a
    keep-alive would fence a healthy stream.)"""
    upstream.queue.append(Script(tokens=8, delay=0.3, prefix="H", keepalive=keepalive))
    async with make_proxy(upstream.url, **{"upstream.healthy_within": 1.0}) as proxy:
        a_text: list[str] = []
        a_first = asyncio.Event()
        a_task = asyncio.create_task(collect(sdk.pieces(proxy.url), a_text, a_first))
        await asyncio.wait_for(a_first.wait(), 10)
        await asyncio.sleep(1.3)  # past the window since the request: alive by its tokens
        assert upstream.seen[0].keepalives_sent >= 1
        b_text: list[str] = []
        await asyncio.wait_for(collect(sdk.pieces(proxy.url), b_text, asyncio.Event()), 10)
        await asyncio.wait_for(a_task, 10)
        assert "".join(a_text) == "".join(b_text) == "H0 H1 H2 H3 H4 H5 H6 H7 "
        assert len(upstream.seen) == 1


@pytest.mark.parametrize("healthy", [True, False])
async def test_following_is_judged_by_the_one_health_function(
    upstream: ScriptedUpstream,
    make_proxy: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
    healthy: bool,
) -> None:
    """With proxy.wire.health.healthy answering `healthy` whatever the clock says, an identical
    request follows the running generation, or replaces it (the WebSocket twin rule calls
    the same function: tests/websocket/test_fence.py)."""
    monkeypatch.setattr(health, "healthy", lambda alive_at, now, within: healthy)
    upstream.queue.extend([Script(tokens=3, gated=True, prefix="A"), Script(prefix="B")])
    async with make_proxy(upstream.url, **{"upstream.healthy_within": 60}) as proxy:
        async with proxy.client() as client, client.stream("POST", CHAT, json=BODY) as a:
            a_events = events(a)
            assert (await anext(a_events)).text == "A0 "
            async with client.stream("POST", CHAT, json=BODY) as b:
                source = b.headers["x-streamfence-source"]
                upstream.seen[0].release(10)
                b_text = "".join([e.text async for e in events(b)])
            rest = [e async for e in a_events]
    assert source == ("followed" if healthy else "upstream")
    assert len(upstream.seen) == (1 if healthy else 2)
    assert b_text == ("A0 A1 A2 " if healthy else "B0 B1 B2 ")
    assert rest[-1].is_error is (not healthy)


@pytest.mark.parametrize(
    ("path", "keepalive", "relayed"),
    [
        pytest.param("/v1beta/models/m:streamGenerateContent", OPENROUTER, False, id="gemini"),
        pytest.param("/v1/messages", ANTHROPIC_PING, True, id="anthropic"),
        pytest.param(CHAT, OPENROUTER, True, id="chat"),
    ],
)
async def test_keepalives_are_relayed_except_comments_on_gemini_paths(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, path: str, keepalive: str, relayed: bool
) -> None:
    """Relayed at once as they came (clients' idle timers need them), except comment lines
    on Gemini paths: google-genai fails to parse one, and Google never sends them."""
    upstream.queue.append(Script(tokens=3, delay=0.1, keepalive=keepalive))
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        body = (await client.post(path, json=chat_body())).content
    assert (keepalive.encode() in body) is relayed
    assert upstream.seen[0].keepalives_sent >= 2
    assert body.count(b"data: ") >= 3
