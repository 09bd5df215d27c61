"""Turn keys (CONTRACT section 3): which in-flight requests are attempts of the same turn.

Resolved in order: an explicit turn header, else a fingerprint of the request body; always
scoped by a hash of the caller's credential, so two callers can never fence each other.
The raw credential is hashed at once and never kept. Pure and I/O-free.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote_plus

import orjson

from proxy.asgi import Headers
from proxy.errors import BadRequest
from proxy.wire.usage import request_model

MAX_TURN_ID_BYTES = 256
OPT_OUT = b"none"
CREDENTIAL_HEADERS = (b"authorization", b"x-api-key", b"api-key", b"x-goog-api-key")
# Gemini clients may put the key in the query string instead of a header.
CREDENTIAL_QUERY = "key"


@dataclass(frozen=True, slots=True)
class TurnKey:
    key: str  # hex SHA-256: safe to store, log and return
    source: str  # "header" or "fingerprint"
    # What "an identical request" means for following: the canonical body's fingerprint
    # (or, for a body that is not JSON, its bytes' hash), and the request's streaming mode.
    body_fingerprint: str | None = None
    streaming: bool = False
    model: str | None = None  # the model the request names (for the ledger, never the key)

    @property
    def short(self) -> str:
        return self.key[:16]


def _sha256(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))  # length-prefixed: no ambiguous joins
        h.update(part)
    return h.hexdigest()


def credential_scope(headers: Headers, query: str = "") -> str:
    """A hash of every credential the caller sent; "anonymous" callers share one scope."""
    found = [name + b"=" + value for name, value in headers if name in CREDENTIAL_HEADERS]
    if query and CREDENTIAL_QUERY + "=" in query:
        found += [b"?key=" + v.encode() for k, v in parse_qsl(query) if k == CREDENTIAL_QUERY]
    if not found:
        return "anonymous"
    return _sha256(b"credential", *sorted(found))


def explicit_turn_id(headers: Headers, header_name: bytes) -> bytes | None:
    """The caller's turn id, validated; None when absent. `b"none"` means opted out."""
    values = [v for n, v in headers if n == header_name]
    if not values:
        return None
    name = header_name.decode("latin-1")
    if len(values) > 1:
        raise BadRequest(f"streamfence: the {name} header must appear at most once")
    return _valid(values[0], f"{name} header")


def _valid(raw: bytes, what: str) -> bytes:
    value = raw.strip()
    if not value:
        raise BadRequest(f"streamfence: the {what} must not be empty")
    if len(value) > MAX_TURN_ID_BYTES:
        raise BadRequest(f"streamfence: the {what} is over {MAX_TURN_ID_BYTES} bytes")
    if any(b < 0x20 or b == 0x7F for b in value):
        raise BadRequest(f"streamfence: the {what} must not contain control characters")
    return value


def fingerprint(route: str, path: str, body: bytes, ignore_fields: Iterable[str]) -> str | None:
    """SHA-256 of route, path and the canonical JSON body without volatile fields.

    A retry resends the same conversation and gets the same fingerprint; the next turn
    appends messages and gets a new one. A body that is not JSON gets none.
    """
    return fingerprint_and_mode(route, path, body, ignore_fields)[0]


def fingerprint_and_mode(
    route: str, path: str, body: bytes, ignore_fields: Iterable[str]
) -> tuple[str | None, bool, str | None]:
    """The fingerprint, whether the request asks for a stream, and the model it names (one
    parse for all three)."""
    streaming = ":streamGenerateContent" in path
    if not body:
        return None, streaming, request_model(None, path)
    try:
        # json.loads, less the decoder it would build for its keywords on every call.
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        parsed: Any = _FINITE_ONLY.decode(text)
        exotic = False
    except _NotFinite:
        parsed, exotic = json.loads(text), True
    except (ValueError, RecursionError):  # invalid JSON or UTF-8; nested too deep to parse
        return None, streaming, request_model(None, path)
    model = request_model(parsed, path)
    if isinstance(parsed, dict):
        streaming = streaming or parsed.get("stream") is True
        for name in ignore_fields:
            parsed.pop(name, None)
    canonical = _canonical(parsed, exotic)
    if canonical is None:
        return None, streaming, model
    return _sha256(b"fingerprint", route.encode(), path.encode(), canonical), streaming, model


class _NotFinite(Exception):
    """NaN or an infinity in a body: orjson would write it as null."""


def _finite(literal: str) -> float:
    value = float(literal)
    if value - value != 0:  # inf - inf is nan; 1e400 parses to inf
        raise _NotFinite
    return value


def _not_finite(literal: str) -> float:
    raise _NotFinite


_FINITE_ONLY = json.JSONDecoder(parse_float=_finite, parse_constant=_not_finite)


def _canonical(parsed: Any, exotic: bool) -> bytes | None:
    """Sorted keys, no whitespace, UTF-8. orjson writes it in a fraction of the json module's time,
    on the event loop, for an agent's body of a hundred kilobytes or more (`python -m
    bench.fingerprint`); the parse stays the json module's, exact for every number. orjson refuses
    what it cannot write exactly (integers past 64 bits, lone surrogates) and would write NaN as
    null: those bodies take the json module's writer, whose output is otherwise the same bytes
    (floats aside, which both write uniquely)."""
    if not exotic:
        try:
            return orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS)
        except orjson.JSONEncodeError:  # also its nesting limit, past 255 levels
            pass
    try:
        canonical = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        return None
    # A lone "\ud83d" escape (a truncated emoji) is valid JSON but not encodable as UTF-8.
    return canonical.encode("utf-8", "surrogatepass")


def split_query_turn(query: str, name: str) -> tuple[str, bytes | None]:
    """The query without the turn-id parameter `name`, and that parameter's value: a browser
    EventSource cannot send headers, so it names its turn in the URL."""
    if not name or name + "=" not in query:
        return query, None
    kept, found = [], None
    for part in query.split("&"):
        key, _, value = part.partition("=")
        if unquote_plus(key) == name:
            found = unquote_plus(value).encode("utf-8", "surrogateescape")
        else:
            kept.append(part)
    return "&".join(kept), found


def _identity(route: str, path: str, query: str, body: bytes) -> str:
    """The identity of a body that is not JSON (or of a bodiless request, with its query)."""
    if body:
        return _sha256(b"raw-body", route.encode(), path.encode(), body)
    scrubbed = "&".join(p for p in query.split("&") if not p.startswith(CREDENTIAL_QUERY + "="))
    return _sha256(b"bodiless", route.encode(), path.encode(), scrubbed.encode())


def resolve(
    headers: list[tuple[bytes, bytes]],
    query: str,
    body: bytes,
    *,
    header_name: bytes,
    route: str,
    path: str,
    use_fingerprint: bool,
    ignore_fields: Iterable[str],
    query_turn_id: bytes | None = None,
) -> TurnKey | None:
    """The request's turn key, or None when it takes no part in fencing."""
    turn_id = explicit_turn_id(headers, header_name)
    if turn_id is None and query_turn_id is not None:
        turn_id = _valid(query_turn_id, "turn id query parameter")
    if turn_id is not None and turn_id.lower() == OPT_OUT:
        return None
    scope = credential_scope(headers, query).encode()
    if turn_id is None and not use_fingerprint:
        return None
    fp, streaming, model = fingerprint_and_mode(route, path, body, ignore_fields)
    if turn_id is not None:
        identity = fp or _identity(route, path, query, body)
        return TurnKey(_sha256(b"turn", scope, turn_id), "header", identity, streaming, model)
    if fp is None:
        return None
    return TurnKey(_sha256(b"turn-fp", scope, fp.encode()), "fingerprint", fp, streaming, model)
