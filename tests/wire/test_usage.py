"""Token usage read from answers, per dialect, in the shapes the providers send (issue 30)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.wire import usage
from proxy.wire.dialects import ANTHROPIC, GEMINI, OPENAI_CHAT, OPENAI_RESPONSES, SSE
from proxy.wire.usage import Kind, Usage


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    text = data if isinstance(data, str) else json.dumps(data)
    return f"{head}data: {text}\n\n".encode()


def chat_chunk(content: str | None, usage_: Any = None) -> bytes:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    return sse(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "model": "gpt-4o-mini-2024-07-18",
            "choices": choices,
            "usage": usage_,  # include_usage: null in every chunk but the last
        }
    )


CHAT_USAGE = {
    "prompt_tokens": 1200,
    "completion_tokens": 340,
    "total_tokens": 1540,
    "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 128, "audio_tokens": 0},
}


def test_openai_chat_final_chunk() -> None:
    events = [chat_chunk("Hel"), chat_chunk("lo"), chat_chunk(None, CHAT_USAGE), sse("[DONE]")]
    assert usage.closing(OPENAI_CHAT, events) == Usage(
        input=1200, output=340, cached_input=1024, reasoning=128, model="gpt-4o-mini-2024-07-18"
    )


def test_openai_chat_without_include_usage_is_unknown() -> None:
    plain = [sse({"choices": [{"delta": {"content": "hi"}}]}), sse("[DONE]")]
    assert usage.closing(OPENAI_CHAT, plain) is None
    nulls = [chat_chunk("hi"), chat_chunk("!"), sse("[DONE]")]  # "usage": null throughout
    assert usage.closing(OPENAI_CHAT, nulls) is None


def test_openai_chat_body() -> None:
    body = {"id": "x", "object": "chat.completion", "model": "gpt-4o", "usage": CHAT_USAGE}
    got = usage.of_body(OPENAI_CHAT, json.dumps(body).encode())
    assert got == Usage(1200, 340, 1024, 128, "gpt-4o")


RESPONSES_USAGE = {
    "input_tokens": 900,
    "input_tokens_details": {"cached_tokens": 512},
    "output_tokens": 210,
    "output_tokens_details": {"reasoning_tokens": 64},
    "total_tokens": 1110,
}


@pytest.mark.parametrize(
    "terminal", ["response.completed", "response.incomplete", "response.failed"]
)
def test_openai_responses_terminal_events(terminal: str) -> None:
    response = {"id": "resp_1", "object": "response", "model": "gpt-5", "usage": RESPONSES_USAGE}
    events = [
        sse({"type": "response.output_text.delta", "delta": "usage"}, "response.output_text.delta"),
        sse({"type": terminal, "sequence_number": 9, "response": response}, terminal),
    ]
    assert usage.closing(OPENAI_RESPONSES, events) == Usage(900, 210, 512, 64, "gpt-5")


def test_openai_responses_failed_without_usage_is_unknown() -> None:
    response = {"id": "resp_1", "object": "response", "usage": None, "error": {"code": "x"}}
    events = [sse({"type": "response.failed", "response": response}, "response.failed")]
    assert usage.closing(OPENAI_RESPONSES, events) is None


def test_openai_responses_body() -> None:
    body = {"id": "resp_1", "object": "response", "model": "gpt-5", "usage": RESPONSES_USAGE}
    assert usage.of_body(OPENAI_RESPONSES, json.dumps(body).encode()) == Usage(
        900, 210, 512, 64, "gpt-5"
    )


def anthropic_start(**counts: int) -> bytes:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [],
        "usage": counts,
    }
    return sse({"type": "message_start", "message": message}, "message_start")


def test_anthropic_input_at_the_start_output_at_the_end() -> None:
    start = anthropic_start(
        input_tokens=20, cache_creation_input_tokens=100, cache_read_input_tokens=2000,
        output_tokens=1,
    )  # fmt: skip
    opened = usage.opening(ANTHROPIC, start)
    # Anthropic's input_tokens leave out the cache: every prompt token counts as input.
    assert opened == Usage(input=2120, output=1, cached_input=2000, model="claude-sonnet-4-5")
    tail = [
        sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 57},
            },
            "message_delta",
        ),  # fmt: skip
        sse({"type": "message_stop"}, "message_stop"),
    ]
    closed = usage.closing(ANTHROPIC, tail)
    assert closed == Usage(output=57)
    assert opened.merged(closed) == Usage(2120, 57, 2000, None, "claude-sonnet-4-5")


def test_anthropic_opening_ignores_other_events_and_other_dialects() -> None:
    assert usage.opening(ANTHROPIC, sse({"type": "ping"}, "ping")) is None
    assert usage.opening(OPENAI_CHAT, anthropic_start(input_tokens=5)) is None


def test_anthropic_body() -> None:
    counts = {"input_tokens": 10, "cache_read_input_tokens": 5, "output_tokens": 3}
    body = {"type": "message", "model": "claude-haiku-4-5", "usage": counts}
    assert usage.of_body(ANTHROPIC, json.dumps(body).encode()) == Usage(
        15, 3, 5, None, "claude-haiku-4-5"
    )


def gemini_chunk(text: str, meta: dict[str, int]) -> bytes:
    return sse(
        {
            "candidates": [{"content": {"parts": [{"text": text}], "role": "model"}}],
            "usageMetadata": meta,
            "modelVersion": "gemini-2.5-flash",
        }
    )


def test_gemini_last_chunk_wins() -> None:
    events = [
        gemini_chunk("a", {"promptTokenCount": 40, "totalTokenCount": 40}),
        gemini_chunk("b", {"promptTokenCount": 40, "candidatesTokenCount": 2}),
        gemini_chunk(
            "c",
            {
                "promptTokenCount": 40,
                "candidatesTokenCount": 7,
                "thoughtsTokenCount": 30,
                "cachedContentTokenCount": 32,
                "totalTokenCount": 77,
            },
        ),  # fmt: skip
    ]
    # Thoughts are output too, as OpenAI's reasoning tokens are part of its completion count.
    assert usage.closing(GEMINI, events) == Usage(40, 37, 32, 30, "gemini-2.5-flash")


def test_gemini_body() -> None:
    body = {"candidates": [], "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 4}}
    assert usage.of_body(GEMINI, json.dumps(body).encode()) == Usage(input=3, output=4)


@pytest.mark.parametrize(
    "event",
    [
        b"data: {not json\n\n",
        b'data: {"usage": {"prompt_tokens": "12"}}\n\n',  # a string: not a count
        b'data: {"usage": {"prompt_tokens": -3, "completion_tokens": true}}\n\n',
        b'data: ["usage"]\n\n',
        b": usage comment\n\n",
        b'data: {"usage": 12}\n\n',
    ],
)
def test_malformed_usage_is_unknown_never_an_error(event: bytes) -> None:
    for dialect in (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC, GEMINI, SSE):
        assert usage.closing(dialect, [event]) is None
        assert usage.of_body(dialect, event.removeprefix(b"data: ")) is None


def test_only_the_last_events_are_looked_at() -> None:
    early = chat_chunk(None, CHAT_USAGE)
    later = [chat_chunk("x") for _ in range(usage.TAIL_EVENTS)]
    assert usage.closing(OPENAI_CHAT, [early, *later]) is None


def test_a_huge_body_is_not_parsed() -> None:
    body = {"usage": CHAT_USAGE, "padding": "x" * usage.MAX_BODY_BYTES}
    assert usage.of_body(OPENAI_CHAT, json.dumps(body).encode()) is None


def test_counts_by_kind() -> None:
    assert dict(Usage(5, None, 2, None).counts()) == {Kind.INPUT: 5, Kind.CACHED_INPUT: 2}


@pytest.mark.parametrize(
    ("body", "path", "model"),
    [
        ({"model": "gpt-4o", "messages": []}, "/v1/chat/completions", "gpt-4o"),
        ({"messages": []}, "/v1beta/models/gemini-2.5-pro:streamGenerateContent", "gemini-2.5-pro"),
        ({"model": 12}, "/v1/chat/completions", None),
        ([1, 2], "/v1/models/x/y", "x"),
        (None, "/v1/chat/completions", None),
    ],
)
def test_the_model_a_request_names(body: Any, path: str, model: str | None) -> None:
    assert usage.request_model(body, path) == model
