"""The official openai and anthropic SDKs as clients, through the proxy, against the
scripted upstream: the loser raises, never sees a success terminator; the winner works."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import Proxy
from tests.scripted import ScriptedUpstream

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def _openai(proxy: Proxy, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=retries)


def _anthropic(proxy: Proxy, retries: int = 0) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=retries)


async def test_openai_chat_loser_raises_and_winner_completes(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    client = _openai(proxy)
    a = await client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        stream=True,
        extra_body={"script": {"gated": True, "prefix": "A"}},
        extra_headers={"X-Turn-Id": "t"},
    )
    a_iter = aiter(a)
    first = await anext(a_iter)
    assert first.choices[0].delta.content == "A0 "
    b = await client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        stream=True,
        extra_body={"script": {"prefix": "B"}},
        extra_headers={"X-Turn-Id": "t"},
    )
    with pytest.raises(openai.APIError) as info:
        async for _ in a_iter:
            pytest.fail("the superseded stream delivered a chunk")
    assert "superseded" in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "stream_superseded"
    text = "".join([c.choices[0].delta.content or "" async for c in b if c.choices])
    assert text == "B0 B1 B2 "
    await client.close()


async def test_openai_responses_loser_raises_and_winner_completes(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    client = _openai(proxy)
    kwargs: dict[str, Any] = {"model": "m", "input": "hi", "stream": True}
    a = await client.responses.create(
        **kwargs,
        extra_body={"script": {"gated": True, "prefix": "A"}},
        extra_headers={"X-Turn-Id": "r"},
    )
    a_iter = aiter(a)
    assert (await anext(a_iter)).type == "response.created"
    b = await client.responses.create(
        **kwargs, extra_body={"script": {"prefix": "B"}}, extra_headers={"X-Turn-Id": "r"}
    )
    seen_types: list[str] = []
    with pytest.raises(openai.APIError) as info:
        async for event in a_iter:
            seen_types.append(event.type)
    assert seen_types == []
    assert "superseded" in info.value.message
    b_events = [e async for e in b]
    assert b_events[-1].type == "response.completed"
    deltas = [e.delta for e in b_events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "B0 B1 B2 "
    await client.close()


async def test_anthropic_loser_raises_and_winner_completes(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    client = _anthropic(proxy)
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 10, "messages": MESSAGES, "stream": True}
    a = await client.messages.create(
        **kwargs,
        extra_body={"script": {"gated": True, "prefix": "A"}},
        extra_headers={"X-Turn-Id": "c"},
    )
    a_iter = aiter(a)
    assert (await anext(a_iter)).type == "message_start"
    b = await client.messages.create(
        **kwargs, extra_body={"script": {"prefix": "B"}}, extra_headers={"X-Turn-Id": "c"}
    )
    seen_types: list[str] = []
    with pytest.raises(anthropic.APIError) as info:
        async for event in a_iter:
            seen_types.append(event.type)
    assert "message_stop" not in seen_types
    assert "superseded" in str(info.value)
    b_events = [e async for e in b]
    assert b_events[-1].type == "message_stop"
    text = "".join(e.delta.text for e in b_events if e.type == "content_block_delta")  # type: ignore[union-attr]
    assert text == "B0 B1 B2 "
    await client.close()


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_sdk_with_retries_does_not_resend_a_request_fenced_before_headers(
    proxy: Proxy, upstream: ScriptedUpstream, sdk: str
) -> None:
    """Without x-should-retry: false, the SDK would retry the 409 and fence the winner."""
    if sdk == "openai":
        client: Any = _openai(proxy, retries=2)
        create = client.chat.completions.create
        kwargs: dict[str, Any] = {"model": "m", "messages": MESSAGES}
        conflict: type[Exception] = openai.ConflictError
    else:
        client = _anthropic(proxy, retries=2)
        create = client.messages.create
        kwargs = {"model": "m", "max_tokens": 10, "messages": MESSAGES}
        conflict = anthropic.ConflictError
    loser = asyncio.create_task(
        create(
            **kwargs,
            extra_body={"script": {"hold_headers": True}},
            extra_headers={"X-Turn-Id": "sdk"},
        )
    )
    await upstream.wait_requests(1)
    winner = await create(**kwargs, extra_headers={"X-Turn-Id": "sdk"})
    with pytest.raises(conflict):
        await loser
    text = winner.choices[0].message.content if sdk == "openai" else winner.content[0].text
    assert text == "0 1 2 "  # the winner's own answer, from its own upstream request
    assert len(upstream.seen) == 2  # one attempt each: the loser was not re-sent
    await proxy.runtime.wait_idle()
    assert proxy.runtime.registry.live_keys() == 0
    await client.close()
