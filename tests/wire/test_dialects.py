"""proxy.wire.dialects: detection, the superseded/error frame of each dialect (CONTRACT section 4)
and the JSON error bodies."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from proxy.errors import (
    BadRequest,
    BodyTooLarge,
    MalformedStream,
    NoRoute,
    RegistryUnavailable,
    StreamfenceError,
    Superseded,
    Unauthorized,
    UpstreamTimeout,
)
from proxy.wire import dialects
from proxy.wire.dialects import (
    ANTHROPIC,
    DIALECTS,
    GEMINI,
    OPENAI_CHAT,
    OPENAI_RESPONSES,
    SSE,
    detect,
    error_body,
    stream_error_frame,
)
from proxy.wire.sse import SSESplitter
from tests.wire.test_sse import reference_events

# --- detection ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "dialect"),
    [
        ("/v1/chat/completions", OPENAI_CHAT),
        ("/api/v1/chat/completions", OPENAI_CHAT),  # OpenRouter
        ("/openai/deployments/gpt4/chat/completions", OPENAI_CHAT),  # Azure
        ("/v1/completions", OPENAI_CHAT),  # legacy completions stream the same chunks
        ("/v1/responses", OPENAI_RESPONSES),
        ("/v1/responses/resp_123", OPENAI_RESPONSES),
        ("/v1/messages", ANTHROPIC),
        ("/v1beta/models/gemini-2.0-flash:streamGenerateContent", GEMINI),
        ("/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse", GEMINI),
        ("/v1beta/models/gemini-2.0-flash:generateContent", GEMINI),
        ("/v1/models", SSE),
        ("/", SSE),
        ("/v1/embeddings", SSE),
        ("/events", SSE),
    ],
)
def test_detect_from_the_path(path: str, dialect: str) -> None:
    assert detect(path) == dialect
    assert detect(path, "auto") == dialect


@pytest.mark.parametrize("configured", DIALECTS)
def test_configured_dialect_overrides_the_path(configured: str) -> None:
    assert detect("/v1/chat/completions", configured) == configured
    assert detect("/whatever", configured) == configured


# --- stream error frames ------------------------------------------------------------------

FORBIDDEN = (
    "terminated",
    "connection lost",
    "network error",
    "peer closed",
    "broken pipe",
    "reset",
)
SUCCESS = (b"[DONE]", b"response.completed", b"message_stop")

CHAT_CHUNK = (
    b'data: {"id":"chatcmpl-9","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"gpt-4o-2024","system_fingerprint":"fp_1","service_tier":"default",'
    b'"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
)
RESPONSES_EVENT = (
    b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","sequence_number":41,"delta":"x"}\n\n'
)
ANTHROPIC_EVENT = (
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}'
    b"\n\n"
)
GEMINI_EVENT = b'data: {"candidates":[{"content":{"parts":[{"text":"x"}]}}]}\r\n\r\n'
LAST = {
    OPENAI_CHAT: CHAT_CHUNK,
    OPENAI_RESPONSES: RESPONSES_EVENT,
    ANTHROPIC: ANTHROPIC_EVENT,
    GEMINI: GEMINI_EVENT,
    SSE: b"data: hello\n\n",
}
ERRORS: list[StreamfenceError] = [
    Superseded(1, 2),
    Superseded(3),
    MalformedStream("streamfence: the upstream sent an SSE event that is not UTF-8"),
    UpstreamTimeout("streamfence: the upstream sent nothing for 600 s"),
]


def parse_frame(frame: bytes) -> tuple[str, dict[str, Any]]:
    # Valid SSE: one whole event, as a client reads it.
    assert SSESplitter(1 << 20).feed(frame) == [frame]
    (event,) = reference_events(frame)
    parsed = json.loads(event.data)
    assert isinstance(parsed, dict)
    return event.type, parsed


def strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list):
        return [s for item in obj for s in strings(item)]
    return []


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("last", [True, False], ids=["after-events", "first"])
@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_frame_is_one_valid_event_and_never_a_success_terminator(
    dialect: str, last: bool, error: StreamfenceError
) -> None:
    frame = stream_error_frame(dialect, error, LAST[dialect] if last else None)
    event_type, body = parse_frame(frame)
    for terminator in SUCCESS:
        assert terminator not in frame
    assert error.message in strings(body)
    if dialect in (OPENAI_CHAT, GEMINI):
        # Data-only events: openai-python and google-genai only look at those, and
        # @google/genai drops a named event silently.
        assert event_type == "message"
        assert b"event:" not in frame
    else:
        assert event_type == "error"


@pytest.mark.parametrize(
    "last", [CHAT_CHUNK, None, b": comment\n\n", b"data: [1]\n\n", b"\xff\n\n"]
)
def test_chat_frame_is_the_error_alone(last: bytes | None) -> None:
    # No `choices` and no chunk fields: with them the Vercel AI SDK reads the event as an
    # empty delta and ends the stream silently (CONTRACT section 4).
    error = Superseded(1, 2)
    _, body = parse_frame(stream_error_frame(OPENAI_CHAT, error, last))
    assert body == {
        "error": {
            "type": "stream_superseded",
            "code": "stream_superseded",
            "message": error.message,
        }
    }


def test_responses_frame_shape_and_sequence_number() -> None:
    error = Superseded(2, 3)
    event_type, body = parse_frame(stream_error_frame(OPENAI_RESPONSES, error, RESPONSES_EVENT))
    inner = {"type": "stream_superseded", "code": "stream_superseded", "message": error.message}
    assert event_type == "error"
    assert body == {
        "type": "error",
        "code": "stream_superseded",
        "message": error.message,
        "param": None,
        "sequence_number": 42,
        "error": {**inner, "param": None},
    }


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        (None, 0),
        (b'data: {"type":"response.created","sequence_number":0}\n\n', 1),
        (b'data: {"type":"response.in_progress"}\n\n', 0),
        (b'data: {"sequence_number":"7"}\n\n', 0),
    ],
)
def test_responses_sequence_number_follows_the_last_event(
    last: bytes | None, expected: int
) -> None:
    _, body = parse_frame(stream_error_frame(OPENAI_RESPONSES, Superseded(1), last))
    assert body["sequence_number"] == expected


def test_anthropic_frame_shape() -> None:
    error = Superseded(1, 2)
    event_type, body = parse_frame(stream_error_frame(ANTHROPIC, error, ANTHROPIC_EVENT))
    assert event_type == "error"
    assert body == {
        "type": "error",
        "error": {"type": "stream_superseded", "message": error.message},
    }


@pytest.mark.parametrize(("dialect", "named"), [(GEMINI, False), (SSE, True)])
def test_gemini_and_generic_frame_shape(dialect: str, named: bool) -> None:
    error = Superseded(1, 2)
    frame = stream_error_frame(dialect, error, LAST[dialect])
    event_type, body = parse_frame(frame)
    # Gemini's is data-only (google-genai cannot parse an `event:` line); a generic SSE
    # client's is a named error event.
    assert (event_type, frame.startswith(b"event: error\n")) == (
        ("error", True) if named else ("message", False)
    )
    assert body == {"error": {"code": 409, "status": "ABORTED", "message": error.message}}
    _, failed = parse_frame(stream_error_frame(dialect, UpstreamTimeout("slow"), None))
    assert failed == {"error": {"code": 504, "status": "DEADLINE_EXCEEDED", "message": "slow"}}


@pytest.mark.parametrize("attempt", [1, 2, 17])
@pytest.mark.parametrize("newer", [None, 2, 18])
def test_superseded_message_has_no_words_of_a_transient_fault(
    attempt: int, newer: int | None
) -> None:
    message = Superseded(attempt, newer).message
    for word in FORBIDDEN:
        assert word not in message.lower(), word
    assert re.search(rf"\battempt {attempt}\b", message)
    assert "superseded" in message
    if newer is not None:
        assert f"attempt {newer}" in message
    for dialect in DIALECTS:
        frame = stream_error_frame(dialect, Superseded(attempt, newer), None).decode().lower()
        body = error_body(dialect, Superseded(attempt, newer)).decode().lower()
        for word in FORBIDDEN:
            assert word not in frame and word not in body, (dialect, word)


def test_message_with_quotes_and_newlines_stays_one_event() -> None:
    error = MalformedStream('bad "event"\nsecond line\r\nthird \u2603')
    for dialect in DIALECTS:
        _, body = parse_frame(stream_error_frame(dialect, error, None))
        assert error.message in strings(body)


# --- error bodies -------------------------------------------------------------------------


@pytest.mark.parametrize("error", [Superseded(1, 2), BadRequest("bad"), NoRoute("nowhere")])
def test_error_body_shapes(error: StreamfenceError) -> None:
    openai = {
        "error": {"message": error.message, "type": error.code, "param": None, "code": error.code}
    }
    assert json.loads(error_body(OPENAI_CHAT, error)) == openai
    assert json.loads(error_body(OPENAI_RESPONSES, error)) == openai
    assert json.loads(error_body(SSE, error)) == openai
    assert json.loads(error_body(ANTHROPIC, error)) == {
        "type": "error",
        "error": {"type": error.code, "message": error.message},
    }
    gemini = json.loads(error_body(GEMINI, error))
    assert gemini["error"]["code"] == error.status
    assert gemini["error"]["message"] == error.message


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (Superseded(1), "ABORTED"),
        (BadRequest("x"), "INVALID_ARGUMENT"),
        (NoRoute("x"), "NOT_FOUND"),
        (MalformedStream("x"), "UNAVAILABLE"),
        (UpstreamTimeout("x"), "DEADLINE_EXCEEDED"),
        (StreamfenceError("x"), "INTERNAL"),
        (Unauthorized("x"), "UNAUTHENTICATED"),
        (BodyTooLarge("x"), "INVALID_ARGUMENT"),
        (RegistryUnavailable("x"), "UNAVAILABLE"),
    ],
)
def test_gemini_status_names(error: StreamfenceError, status: str) -> None:
    assert json.loads(error_body(GEMINI, error))["error"]["status"] == status


def test_bodies_are_utf8_json_without_escaping_text() -> None:
    error = BadRequest("caf\u00e9")
    for dialect in dialects.DIALECTS:
        raw = error_body(dialect, error)
        assert "caf\u00e9".encode() in raw
        json.loads(raw)


# --- whatever the upstream's last event held, the frame still goes out --------------------

HOSTILE_LAST = [
    b"data: " + b"[" * 5000 + b"]" * 5000 + b"\n\n",  # too deep to parse
    b'data: {"id":"\\ud800","model":"m"}\n\n',  # lone surrogate: not encodable as UTF-8
    b'data: {"id":' + b"[" * 900 + b"]" * 900 + b',"model":"m"}\n\n',  # deep but parseable
    b'data: {"id":{"a":1},"created":NaN,"model":["x"],"object":null}\n\n',
    b'data: {"sequence_number":' + b"[" * 900 + b"]" * 900 + b"}\n\n",
]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("last", HOSTILE_LAST)
def test_frame_never_fails_on_a_hostile_last_event(dialect: str, last: bytes) -> None:
    _, body = parse_frame(stream_error_frame(dialect, Superseded(1, 2), last))
    if dialect == OPENAI_CHAT:
        assert list(body) == ["error"] and body["error"]["code"] == "stream_superseded"
    if dialect == OPENAI_RESPONSES:
        assert body["sequence_number"] == 0


@pytest.mark.parametrize(
    ("dialect", "event", "last"),
    [
        (dialects.OPENAI_CHAT, b"data: [DONE]\n\n", True),
        (dialects.OPENAI_CHAT, b"data:[DONE]\r\n\r\n", True),
        (dialects.OPENAI_CHAT, b"id: 7\ndata: [DONE]\n\n", True),  # an id line first
        (dialects.OPENAI_CHAT, b'data: {"choices":[{"delta":{"content":"[DONE]"}}]}\n\n', False),
        (dialects.OPENAI_RESPONSES, b'event: response.completed\ndata: {"type":"x"}\n\n', True),
        # data before event (field order is free), Python's spaced JSON, no event line at all
        (dialects.OPENAI_RESPONSES, b"data: {}\nevent: response.failed\n\n", True),
        (
            dialects.OPENAI_RESPONSES,
            b'data: {"type": "response.completed", "response": {}}\n\n',
            True,
        ),
        (dialects.OPENAI_RESPONSES, b'data: {"type":"response.incomplete"}\r\n\r\n', True),
        (
            dialects.OPENAI_RESPONSES,
            b'event: response.output_text.delta\ndata: {"delta":"response.completed"}\n\n',
            False,
        ),
        (dialects.ANTHROPIC, b'event: message_stop\ndata: {"type":"message_stop"}\n\n', True),
        (dialects.ANTHROPIC, b'data: {"type": "message_stop"}\n\n', True),
        (
            dialects.ANTHROPIC,
            b'event: content_block_delta\ndata: {"delta":{"text":"message_stop"}}\n\n',
            False,
        ),
        (dialects.GEMINI, b'data: {"candidates":[{"finishReason":"STOP"}]}\n\n', False),
        (dialects.SSE, b"data: [DONE]\n\n", False),
    ],
)
def test_the_last_event_of_a_stream_is_told_whatever_the_servers_layout(
    dialect: str, event: bytes, last: bool
) -> None:
    assert dialects.is_terminal(dialect, event) is last


DELTA = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'


@pytest.mark.parametrize(
    ("dialect", "events", "last"),
    [
        (dialects.OPENAI_CHAT, [DELTA, b"data: [DONE]\n\n", b": keep-alive\n\n"], True),
        (dialects.OPENAI_CHAT, [DELTA, b'data: {"delta":"[DONE]"}\n\n', DELTA], False),
        (dialects.OPENAI_CHAT, [DELTA] * 3, False),
        (
            dialects.ANTHROPIC,
            [b"event: ping\ndata: {}\n\n", b'event: message_stop\ndata: {"type":"x"}\n\n'],
            True,
        ),
        (
            dialects.OPENAI_RESPONSES,
            [b'data: {"delta":"response.completed"}\n\n', b'data: {"type":"response.done"}\n\n'],
            False,
        ),
        (dialects.SSE, [b"data: [DONE]\n\n"] * 2, False),
    ],
)
def test_a_batch_ends_its_stream_when_any_of_its_events_does(
    dialect: str, events: list[bytes], last: bool
) -> None:
    assert dialects.ends_in(dialect, events, b"".join(events)) is last
    assert last is any(dialects.is_terminal(dialect, e) for e in events)
