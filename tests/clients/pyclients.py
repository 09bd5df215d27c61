"""Python client libraries as the scenarios drive them: one `call` per request, with each
library's DEFAULT retry settings, reporting what the library surfaced to its user.

Every adapter gets the same `Call` and returns an `Outcome`; `Call.first` is set when the
library hands its user the first piece of text, so a scenario can act mid-stream.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

API_KEY = "sk-streamfence-client-test"


@dataclass
class Call:
    base: str  # the proxy's URL
    prompt: str = "hi"
    stream: bool = True
    turn: str | None = None  # an explicit X-Turn-Id
    headers: dict[str, str] = field(default_factory=dict)  # more request headers
    first: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Outcome:
    text: str = ""
    error: str | None = None  # the class name of what the library raised or reported
    message: str = ""
    status: int | None = None

    @classmethod
    def failed(cls, text: str, exc: BaseException) -> Outcome:
        status = getattr(exc, "status_code", None) or getattr(exc, "code", None)
        return cls(
            text=text,
            error=type(exc).__name__,
            message=str(exc),
            status=status if isinstance(status, int) else None,
        )


Adapter = Callable[[Call], Awaitable[Outcome]]


def _headers(call: Call) -> dict[str, str]:
    return {**call.headers, **({"X-Turn-Id": call.turn} if call.turn else {})}


async def _collect(call: Call, pieces: AsyncIterator[str]) -> Outcome:
    text = ""
    try:
        async for piece in pieces:
            if piece:
                text += piece
                call.first.set()
    except Exception as exc:  # what the library raised is the result
        return Outcome.failed(text, exc)
    return Outcome(text=text)


async def _whole(call: Call, answer: Awaitable[str]) -> Outcome:
    try:
        text = await answer
    except Exception as exc:
        return Outcome.failed("", exc)
    call.first.set()
    return Outcome(text=text)


def _messages(call: Call) -> list[Any]:
    return [{"role": "user", "content": call.prompt}]


async def openai_chat(call: Call) -> Outcome:
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{call.base}/v1", api_key=API_KEY, default_headers=_headers(call)
    )
    async with client:
        if not call.stream:

            async def whole() -> str:
                done = await client.chat.completions.create(model="m", messages=_messages(call))
                return done.choices[0].message.content or ""

            return await _whole(call, whole())

        async def pieces() -> AsyncIterator[str]:
            stream = await client.chat.completions.create(
                model="m", messages=_messages(call), stream=True
            )
            async for chunk in stream:
                for choice in chunk.choices:
                    yield choice.delta.content or ""

        return await _collect(call, pieces())


async def openai_responses(call: Call) -> Outcome:
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{call.base}/v1", api_key=API_KEY, default_headers=_headers(call)
    )
    async with client:
        if not call.stream:

            async def whole() -> str:
                done = await client.responses.create(model="m", input=call.prompt)
                return done.output_text

            return await _whole(call, whole())

        async def pieces() -> AsyncIterator[str]:
            stream = await client.responses.create(model="m", input=call.prompt, stream=True)
            async for event in stream:
                if event.type == "response.output_text.delta":
                    yield event.delta

        return await _collect(call, pieces())


async def anthropic_messages(call: Call) -> Outcome:
    import anthropic

    client = anthropic.AsyncAnthropic(
        base_url=call.base, api_key=API_KEY, default_headers=_headers(call)
    )
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 64, "messages": _messages(call)}
    async with client:
        if not call.stream:

            async def whole() -> str:
                done = await client.messages.create(**kwargs)
                return "".join(b.text for b in done.content if b.type == "text")

            return await _whole(call, whole())

        async def pieces() -> AsyncIterator[str]:
            stream = await client.messages.create(**kwargs, stream=True)
            async for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    yield event.delta.text

        return await _collect(call, pieces())


async def google_genai(call: Call) -> Outcome:
    from google import genai
    from google.genai import types

    client = genai.Client(
        api_key=API_KEY,
        http_options=types.HttpOptions(base_url=call.base, headers=_headers(call)),
    )
    try:
        if not call.stream:

            async def whole() -> str:
                done = await client.aio.models.generate_content(model="m", contents=call.prompt)
                return done.text or ""

            return await _whole(call, whole())

        async def pieces() -> AsyncIterator[str]:
            stream = await client.aio.models.generate_content_stream(
                model="m", contents=call.prompt
            )
            async for chunk in stream:
                yield chunk.text or ""

        return await _collect(call, pieces())
    finally:
        await client.aio.aclose()


def _litellm_kwargs(call: Call) -> dict[str, Any]:
    return {
        "model": "openai/m",
        "api_base": f"{call.base}/v1",
        "api_key": API_KEY,
        "extra_headers": _headers(call),
    }


async def litellm_cleanup() -> None:
    """litellm caches its HTTP clients process-wide, and every test has its own event loop:
    closed after each test (not after each call: twins share one)."""
    import litellm
    from litellm.llms.custom_httpx.async_client_cleanup import close_litellm_async_clients

    await close_litellm_async_clients()
    litellm.in_memory_llm_clients_cache.flush_cache()


async def _litellm_run(call: Call, create: Callable[..., Awaitable[Any]]) -> Outcome:
    if not call.stream:

        async def whole() -> str:
            done = await create(messages=_messages(call))
            return str(done.choices[0].message.content or "")

        return await _whole(call, whole())

    async def pieces() -> AsyncIterator[str]:
        stream = await create(messages=_messages(call), stream=True)
        async for chunk in stream:
            for choice in chunk.choices:
                yield choice.delta.content or ""

    return await _collect(call, pieces())


async def litellm_completion(call: Call) -> Outcome:
    import litellm

    kwargs = _litellm_kwargs(call)

    async def create(**more: Any) -> Any:
        return await litellm.acompletion(**kwargs, **more)

    return await _litellm_run(call, create)


async def litellm_router(call: Call) -> Outcome:
    import litellm

    params = _litellm_kwargs(call)
    router = litellm.Router(
        model_list=[{"model_name": "m", "litellm_params": params}], num_retries=2
    )

    async def create(**more: Any) -> Any:
        return await router.acompletion(model="m", **more)

    return await _litellm_run(call, create)


async def langchain_openai(call: Call) -> Outcome:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model="m",
        base_url=f"{call.base}/v1",
        api_key=API_KEY,  # type: ignore[arg-type]
        default_headers=_headers(call),
    )
    try:
        if not call.stream:

            async def whole() -> str:
                return str((await chat.ainvoke(call.prompt)).content)

            return await _whole(call, whole())

        async def pieces() -> AsyncIterator[str]:
            async for chunk in chat.astream(call.prompt):
                yield str(chunk.content)

        return await _collect(call, pieces())
    finally:
        _langchain_made.append(chat.root_async_client)


# langchain-openai shares one HTTP client per base URL (an lru_cache) and never closes it:
# twins share it, so it is closed after the test, not after a call.
_langchain_made: list[Any] = []


async def langchain_cleanup() -> None:
    from langchain_openai.chat_models import _client_utils

    while _langchain_made:
        await _langchain_made.pop().close()
    _client_utils._cached_async_httpx_client.cache_clear()


PYTHON_CLIENTS: dict[str, Adapter] = {
    "py-openai-chat": openai_chat,
    "py-openai-responses": openai_responses,
    "py-anthropic": anthropic_messages,
    "py-google-genai": google_genai,
    "py-litellm": litellm_completion,
    "py-litellm-router": litellm_router,
    "py-langchain-openai": langchain_openai,
}

# The library each client imports at its first call, imported before a scenario starts (the
# `world` fixture): an import blocks the event loop the proxy and the upstream run on, for
# seconds (litellm's took 5.6 s on a loaded machine, the first test of each xdist worker
# timed out waiting for its first token), and must not count against a scenario's bounds.
LIBRARIES: dict[str, str] = {
    "py-openai-chat": "openai",
    "py-openai-responses": "openai",
    "py-anthropic": "anthropic",
    "py-google-genai": "google.genai",
    "py-litellm": "litellm",
    "py-litellm-router": "litellm",
    "py-langchain-openai": "langchain_openai",
}

CLEANUP: dict[str, Callable[[], Awaitable[None]]] = {
    "py-litellm": litellm_cleanup,
    "py-litellm-router": litellm_cleanup,
    "py-langchain-openai": langchain_cleanup,
}

# litellm looks for a model cost map online at import unless told to use its local copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
