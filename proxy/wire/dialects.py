"""What each provider's clients understand: how to tell them a stream was superseded or
failed mid-way, and what an error body looks like before any header was sent.

The frames follow CONTRACT section 4: never a success terminator, always something the
official SDKs raise on. Pure and I/O-free.
"""

from __future__ import annotations

import json
from typing import Any, Final, NamedTuple

from proxy.errors import StreamfenceError
from proxy.wire.sse import encode_event, parse_fields

OPENAI_CHAT: Final = "openai-chat"
OPENAI_RESPONSES: Final = "openai-responses"
ANTHROPIC: Final = "anthropic"
GEMINI: Final = "gemini"
SSE: Final = "sse"
DIALECTS: Final = (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC, GEMINI, SSE)

# Google's canonical status names, for Gemini-shaped errors.
_GOOGLE_STATUS: Final = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}

# The types of a stream's last event, per dialect: once one is written, the client has the
# whole answer, whatever it does next (hermes-agent closes right after `[DONE]`). Gemini and
# plain SSE have none: their end is the end of the body.
_TERMINAL_TYPES: Final = {
    OPENAI_RESPONSES: ("response.completed", "response.incomplete", "response.failed"),
    ANTHROPIC: ("message_stop",),
}
_TERMINAL_MARKS: Final = {d: tuple(t.encode() for t in ts) for d, ts in _TERMINAL_TYPES.items()}
# What a terminal event contains, for a first test on a whole batch of them.
_BATCH_MARKS: Final = {OPENAI_CHAT: (b"[DONE]",), **_TERMINAL_MARKS}


def detect(path: str, configured: str = "auto") -> str:
    """The dialect of a request: the configured one, else guessed from the path."""
    if configured != "auto":
        return configured
    if ":streamGenerateContent" in path or ":generateContent" in path:
        return GEMINI
    if path.endswith("/completions"):
        return OPENAI_CHAT
    if path.endswith("/responses") or "/responses/" in path:
        return OPENAI_RESPONSES
    if path.endswith("/messages"):
        return ANTHROPIC
    return SSE


# Keep-alives (CONTRACT section 3; docs/keepalives.md says where each was found): what a
# dialect's providers send only to show that the connection is alive. They are relayed as they
# came (clients' own idle timers need them) but are not content: they do not keep a stalled
# generation healthy. Every dialect's keep-alive is an SSE block of comment lines only (`: ping`,
# OpenRouter's `: OPENROUTER PROCESSING`, sse-starlette's `: ping - <date>`); some dialects
# name keep-alive events of their own, always as the block's first line.
_KEEPALIVE_EVENTS: Final = {
    ANTHROPIC: ("ping",),  # `event: ping` / `data: {"type": "ping"}`
    OPENAI_RESPONSES: ("keepalive",),  # `event: keepalive` / `data: {"type":"keepalive",...}`
    # An unknown stream: the two names above, the usual ones for a liveness event.
    SSE: ("ping", "keepalive"),
}


def names_keepalive(dialect: str, event_type: object) -> bool:
    """`event_type` (an event's `type`, where a WebSocket message carries it in its JSON) is
    one of `dialect`'s keep-alive events."""
    return event_type in _KEEPALIVE_EVENTS.get(dialect, ())


def keepalive_starts(dialect: str) -> tuple[bytes, ...]:
    """The first bytes of a block of `dialect` that may be a keep-alive (`is_keepalive`
    decides): a content event starts with none of them, so one `startswith` clears it."""
    starts = [b":", b"\n", b"\r"]  # a comment; a stray blank line before one
    for name in _KEEPALIVE_EVENTS.get(dialect, ()):
        for sep in (b"event: ", b"event:"):
            starts += [sep + name.encode() + end for end in (b"\n", b"\r")]
    return tuple(starts)


def keepalive_firsts(starts: tuple[bytes, ...]) -> bytes:
    """The first bytes of `starts`: an event whose first byte is none of them is content.
    The relay's test before `carries_content` (a byte looked up, not a call per event)."""
    return bytes(sorted({start[0] for start in starts}))


def drops_keepalives(dialect: str) -> bool:
    """Keep-alives are not relayed to this dialect's clients: google-genai fails on a comment
    line, and Google's API never sends one (only intermediaries do)."""
    return dialect == GEMINI


class KeepAlives(NamedTuple):
    """What a generation of one dialect needs to tell its keep-alives, made once."""

    starts: tuple[bytes, ...]
    firsts: bytes
    dropped: bool


_KEEPALIVES: Final = {
    d: KeepAlives(keepalive_starts(d), keepalive_firsts(keepalive_starts(d)), drops_keepalives(d))
    for d in DIALECTS
}


def keepalives(dialect: str) -> KeepAlives:
    """`dialect`'s keep-alives (a dict look-up: this runs per request)."""
    return _KEEPALIVES.get(dialect) or _KEEPALIVES[SSE]


def is_keepalive(event: bytes, starts: tuple[bytes, ...]) -> bool:
    """`event` (one raw SSE block) is a keep-alive of the dialect whose `keepalive_starts`
    are `starts`: a block of comment lines only (an `id:` or `retry:` line beside them
    dispatches nothing either), or one whose first line names a keep-alive event."""
    if not event.startswith(starts):
        return False  # the usual case: `data:`, `event: <content>`, `id:`
    if event[0] in b"\r\n":
        event = event.lstrip(b"\r\n")
        if not event:
            return True  # blank lines alone: nothing was sent
        if not event.startswith(starts):
            return False
    if event[0] != 0x3A:  # not ":": the first line named a keep-alive event
        return True
    # Comments first: a keep-alive unless a data line follows (that block is an event).
    return event.find(b"\ndata") < 0 and event.find(b"\rdata") < 0


def carries_content(events: list[bytes], starts: tuple[bytes, ...]) -> bool:
    """Some of `events` (the complete events of one read) is content, not a keep-alive:
    what keeps a generation healthy. One `startswith` per event on the relay's path."""
    for event in events:  # a loop, not any(): this runs per read
        if not event.startswith(starts) or not is_keepalive(event, starts):
            return True
    return False


def without_keepalives(events: list[bytes], starts: tuple[bytes, ...]) -> list[bytes]:
    """`events` less its keep-alives (for a dialect that `drops_keepalives`)."""
    return [e for e in events if not is_keepalive(e, starts)]


# On the hot path bytes are searched with `find`, not `in`: `sub in data` first tries `sub`
# as an integer (`65 in b"A"`) and builds and drops a TypeError each time, about a thousand
# instructions, several times a relayed event (python -m bench.instructions).


def is_terminal(dialect: str, event: bytes) -> bool:
    """`event` is its stream's last one (a success or a final failure the upstream sent).

    A substring test first, on every relayed event; only an event that passes it is parsed,
    so that field order (`id:` or `data:` before `event:`), spacing and the JSON's own
    formatting (servers differ) do not matter, and a text delta that merely mentions
    `[DONE]` or `message_stop` is not taken for the end."""
    if dialect == OPENAI_CHAT:
        if event.find(b"[DONE]") < 0:
            return False
        return parse_fields(event).get("data", "").strip() == "[DONE]"
    marks = _TERMINAL_MARKS.get(dialect)
    if marks is None or all(event.find(mark) < 0 for mark in marks):
        return False
    types = _TERMINAL_TYPES[dialect]
    if parse_fields(event).get("event") in types:
        return True
    return _last_json(event).get("type") in types


def ends_in(dialect: str, events: list[bytes], body: bytes) -> bool:
    """One of `events` (`body`, their bytes together) is its stream's last one.

    One substring test on the whole batch first: a relayed batch of many events is then not
    a Python call per event (at a fast stream's batches of a thousand, that was a third of
    the proxy's time); only a batch that passes it is looked at event by event."""
    for mark in _BATCH_MARKS.get(dialect, ()):  # a loop, not any(): this runs per write
        if body.find(mark) >= 0:
            return any(is_terminal(dialect, event) for event in events)
    return False


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _last_json(last_event: bytes | None) -> dict[str, Any]:
    if not last_event:
        return {}
    data = parse_fields(last_event).get("data", "")
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):  # the upstream's bytes: anything may come
        return {}
    return parsed if isinstance(parsed, dict) else {}


def stream_error_frame(dialect: str, error: StreamfenceError, last_event: bytes | None) -> bytes:
    """The final event of a stream that ends with `error` (superseded, upstream failure).

    `last_event` is the raw last event the client received; parsed only here, never on
    the hot path, to make the frame fit the stream (the Responses sequence number).
    """
    code, message = error.code, error.message
    if dialect == OPENAI_CHAT:
        # The error alone: with `choices` or chunk fields beside it, the Vercel AI SDK's
        # schema reads the event as an empty delta and ends the stream silently.
        err = {"type": code, "code": code, "message": message}
        return encode_event(_dumps({"error": err}))
    if dialect == OPENAI_RESPONSES:
        seq = _last_json(last_event).get("sequence_number")
        frame: dict[str, Any] = {
            "type": "error",
            "code": code,
            "message": message,
            "param": None,
            "sequence_number": seq + 1 if isinstance(seq, int) else 0,
            "error": {"type": code, "code": code, "message": message, "param": None},
        }
        return encode_event(_dumps(frame), event="error")
    if dialect == ANTHROPIC:
        return encode_event(
            _dumps({"type": "error", "error": {"type": code, "message": message}}), event="error"
        )
    if dialect == GEMINI:
        # No `event:` line: google-genai fails to parse one ("Failed to parse ... event:")
        # and @google/genai drops a named event silently; both raise on a data-only error.
        return encode_event(_dumps(_google_error(error)))
    return encode_event(_dumps(_google_error(error)), event="error")


def _google_error(error: StreamfenceError) -> dict[str, Any]:
    status = _GOOGLE_STATUS.get(error.status, "INTERNAL")
    return {"error": {"code": error.status, "status": status, "message": error.message}}


def error_body(dialect: str, error: StreamfenceError) -> bytes:
    """The JSON body of an HTTP error response, in the shape the caller's SDK parses."""
    code, message = error.code, error.message
    body: dict[str, Any]
    if dialect == ANTHROPIC:
        body = {"type": "error", "error": {"type": code, "message": message}}
    elif dialect == GEMINI:
        body = _google_error(error)
    else:
        body = {"error": {"message": message, "type": code, "param": None, "code": code}}
    return _dumps(body).encode()
