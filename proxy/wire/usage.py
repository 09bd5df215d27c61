"""Token usage as each provider reports it in its answer, and the model a request names.

Nothing here runs per relayed event: a stream is looked at twice, at its first content event
(Anthropic reports the input tokens in `message_start`, so a generation fenced mid-answer
still has them) and at its last few events (every dialect reports the final counts at the
end), and a non-streaming body once, whole, under a size cap. An answer with no usage, or
with usage that does not parse, is unknown (None): never an error, and never a change to
what the client receives.

The four kinds mean the same for every provider, so that they add up across upstreams:
- `input`: every prompt token, cached ones included (OpenAI's and Gemini's prompt counts
  already include them; Anthropic's `input_tokens` does not, so its cache reads and writes
  are added);
- `cached_input`: the part of `input` read from a cache (OpenAI's cached tokens, Anthropic's
  cache reads, Gemini's cached content);
- `output`: every generated token, reasoning included (OpenAI's completion count already
  includes it; Gemini's thoughts are added to its candidates);
- `reasoning`: the part of `output` spent thinking.

Pure and I/O-free.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

import orjson

from proxy.wire.dialects import ANTHROPIC, GEMINI, OPENAI_CHAT, OPENAI_RESPONSES
from proxy.wire.sse import parse_fields

# A non-streaming body is parsed for its usage only under this size: the proxy streams
# bodies through, and a huge one (a file, an embedding batch) is not worth a second copy.
MAX_BODY_BYTES = 4 << 20
# How many of a stream's last events may hold its final usage: OpenAI's usage chunk comes
# just before `[DONE]`, Anthropic's `message_delta` just before `message_stop`.
TAIL_EVENTS = 4
# A model name longer than this, or with control characters, is not one (odd or hostile).
MAX_MODEL_CHARS = 200


class Kind(StrEnum):
    INPUT = "input"
    OUTPUT = "output"
    CACHED_INPUT = "cached_input"
    REASONING = "reasoning"


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one answer; None where the provider did not say."""

    input: int | None = None
    output: int | None = None
    cached_input: int | None = None
    reasoning: int | None = None
    model: str | None = None  # the model that answered, as the response names it

    def counts(self) -> Iterator[tuple[Kind, int]]:
        """The known counts, by kind."""
        for kind in Kind:
            value = getattr(self, kind.value)
            if value is not None:
                yield kind, value

    def merged(self, later: Usage | None) -> Usage:
        """These counts, updated by what a later event of the same answer says."""
        if later is None:
            return self
        known = {f.name: getattr(later, f.name) for f in fields(later)}
        return replace(self, **{k: v for k, v in known.items() if v is not None})


def reports_opening(dialect: str) -> bool:
    """A stream of `dialect` reports usage in its first content event (`opening`)."""
    return dialect == ANTHROPIC


def opening(dialect: str, event: bytes) -> Usage | None:
    """What a stream's first content event says (only Anthropic's says anything)."""
    if dialect != ANTHROPIC or event.find(b"message_start") < 0:
        return None
    data = _data(event)
    if data is None or data.get("type") != "message_start":
        return None
    message = data.get("message")
    return _anthropic(message) if isinstance(message, dict) else None


def closing(dialect: str, events: Sequence[bytes]) -> Usage | None:
    """The final usage among a stream's last events (the latest event that has one)."""
    found: Usage | None = None
    for event in events[-TAIL_EVENTS:]:
        if event.find(b"sage") < 0:  # "usage", "usageMetadata": nothing else is parsed
            continue
        data = _data(event)
        usage = None if data is None else of_event(dialect, data)
        if usage is not None:
            found = usage if found is None else found.merged(usage)
    return found


def of_body(dialect: str, body: bytes) -> Usage | None:
    """The usage of a whole non-streaming JSON answer, if it is small enough to look at."""
    if len(body) > MAX_BODY_BYTES or body.find(b"sage") < 0:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    if dialect == OPENAI_RESPONSES and data.get("object") == "response":
        return _responses(data)
    return of_event(dialect, data)


def request_model(body: Any, path: str) -> str | None:
    """The model a request asks for: its body's `model`, or Gemini's path
    (`/v1beta/models/<model>:generateContent`)."""
    if isinstance(body, dict):  # (parsed JSON; an ABC's isinstance costs a visible share)
        model = body.get("model")
        if isinstance(model, str) and 0 < len(model) <= MAX_MODEL_CHARS and model.isprintable():
            return model
    marker = "/models/"
    at = path.find(marker)
    if at >= 0:
        name = path[at + len(marker) :].partition(":")[0].partition("/")[0]
        return name if 0 < len(name) <= MAX_MODEL_CHARS and name.isprintable() else None
    return None


def model_of(body: bytes, path: str) -> str | None:
    """The model of a request whose body was not read for its fingerprint (no turn key):
    parsed here, if it is small enough to look at."""
    if not body.startswith(b"{") or len(body) > MAX_BODY_BYTES:
        return request_model(None, path)
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    return request_model(parsed, path)


def _data(event: bytes) -> dict[str, Any] | None:
    text = parse_fields(event).get("data")
    if not text or text[0] != "{":
        return None
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def of_event(dialect: str, data: dict[str, Any]) -> Usage | None:
    """The usage of one parsed event (or whole answer) of `dialect`, where it reports one (a
    WebSocket's Responses events come parsed)."""
    if dialect == GEMINI or "usageMetadata" in data:
        return _gemini(data)
    if dialect == ANTHROPIC:
        if data.get("type") == "message_start" and isinstance(data.get("message"), dict):
            return _anthropic(data["message"])
        return _anthropic(data)  # message_delta, or a whole message
    if dialect == OPENAI_RESPONSES:
        response = data.get("response")
        return _responses(response) if isinstance(response, dict) else None
    if dialect == OPENAI_CHAT or "usage" in data:
        return _chat(data)
    return None


def _count(value: Any) -> int | None:
    # bool is an int in Python; a provider never reports a count as true.
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


def _dig(data: Any, *path: str) -> int | None:
    for name in path:
        if not isinstance(data, dict):
            return None
        data = data.get(name)
    return _count(data)


def _model(data: dict[str, Any], name: str = "model") -> str | None:
    model = data.get(name)
    return model if isinstance(model, str) and model else None


def _known(usage: Usage) -> Usage | None:
    return usage if any(True for _ in usage.counts()) else None


def _chat(data: dict[str, Any]) -> Usage | None:
    # (OpenAI sends "usage": null in every chunk but the last: not a dict, unknown)
    return _openai(data, "prompt_tokens", "completion_tokens")


def _responses(response: dict[str, Any]) -> Usage | None:
    return _openai(response, "input_tokens", "output_tokens")


def _openai(data: dict[str, Any], input_key: str, output_key: str) -> Usage | None:
    """Chat completions and Responses name the same four counts two ways (`prompt_tokens`
    and `prompt_tokens_details.cached_tokens`; `input_tokens` and `input_tokens_details...`)."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return None
    return _known(
        Usage(
            input=_count(usage.get(input_key)),
            output=_count(usage.get(output_key)),
            cached_input=_dig(usage, f"{input_key}_details", "cached_tokens"),
            reasoning=_dig(usage, f"{output_key}_details", "reasoning_tokens"),
            model=_model(data),
        )
    )


def _anthropic(message: dict[str, Any]) -> Usage | None:
    usage = message.get("usage")
    if not isinstance(usage, dict):
        return None
    base = _count(usage.get("input_tokens"))
    reads = _count(usage.get("cache_read_input_tokens"))
    writes = _count(usage.get("cache_creation_input_tokens"))
    total = None if base is None else base + (reads or 0) + (writes or 0)
    return _known(
        Usage(
            input=total,
            output=_count(usage.get("output_tokens")),
            cached_input=reads,
            model=_model(message),
        )
    )


def _gemini(data: dict[str, Any]) -> Usage | None:
    usage = data.get("usageMetadata")
    if not isinstance(usage, dict):
        return None
    candidates = _count(usage.get("candidatesTokenCount"))
    thoughts = _count(usage.get("thoughtsTokenCount"))
    output = (
        None if candidates is None and thoughts is None else (candidates or 0) + (thoughts or 0)
    )
    return _known(
        Usage(
            input=_count(usage.get("promptTokenCount")),
            output=output,
            cached_input=_count(usage.get("cachedContentTokenCount")),
            reasoning=thoughts,
            model=_model(data, "modelVersion"),
        )
    )
