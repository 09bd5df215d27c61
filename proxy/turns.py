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
from urllib.parse import parse_qsl

from proxy.errors import BadRequest

MAX_TURN_ID_BYTES = 256
OPT_OUT = b"none"
CREDENTIAL_HEADERS = (b"authorization", b"x-api-key", b"api-key", b"x-goog-api-key")
# Gemini clients may put the key in the query string instead of a header.
CREDENTIAL_QUERY = "key"

Headers = Iterable[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class TurnKey:
    key: str  # hex SHA-256: safe to store, log and return
    source: str  # "header" or "fingerprint"
    # The body's fingerprint when it was computed for the key: join mode reuses it rather
    # than parsing and canonicalising the body a second time.
    body_fingerprint: str | None = None

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
    value = values[0].strip()
    if not value:
        raise BadRequest(f"streamfence: the {name} header must not be empty")
    if len(value) > MAX_TURN_ID_BYTES:
        raise BadRequest(f"streamfence: the {name} header is over {MAX_TURN_ID_BYTES} bytes")
    if any(b < 0x20 or b == 0x7F for b in value):
        raise BadRequest(f"streamfence: the {name} header must not contain control characters")
    return value


def fingerprint(route: str, path: str, body: bytes, ignore_fields: Iterable[str]) -> str | None:
    """SHA-256 of route, path and the canonical JSON body without volatile fields.

    A retry resends the same conversation and gets the same fingerprint; the next turn
    appends messages and gets a new one. A body that is not JSON gets none.
    """
    if not body:
        return None
    try:
        parsed: Any = json.loads(body)
        if isinstance(parsed, dict):
            for name in ignore_fields:
                parsed.pop(name, None)
        canonical = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError):  # invalid JSON or UTF-8; nested too deep to parse
        return None
    # A lone "\ud83d" escape (a truncated emoji) is valid JSON but not encodable as UTF-8.
    text = canonical.encode("utf-8", "surrogatepass")
    return _sha256(b"fingerprint", route.encode(), path.encode(), text)


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
) -> TurnKey | None:
    """The request's turn key, or None when it takes no part in fencing."""
    turn_id = explicit_turn_id(headers, header_name)
    if turn_id is not None and turn_id.lower() == OPT_OUT:
        return None
    scope = credential_scope(headers, query).encode()
    if turn_id is not None:
        return TurnKey(_sha256(b"turn", scope, turn_id), "header")
    if not use_fingerprint:
        return None
    fp = fingerprint(route, path, body, ignore_fields)
    if fp is None:
        return None
    return TurnKey(_sha256(b"turn-fp", scope, fp.encode()), "fingerprint", fp)
