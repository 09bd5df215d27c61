"""What one request did, as the log line, the metrics, the status page and the traces read
it: the `Record` each request fills as it goes, how it ended (`Outcome`) and how it was
served (`Source`). Never a credential or a body: the record has no field that could hold one.
Turn keys are already hashes; only their first 16 hex digits are kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from proxy.wire.usage import Usage


class Outcome(StrEnum):
    """How a request ended: the log line's `outcome`, the metrics' label."""

    PENDING = "pending"  # not ended yet
    COMPLETED = "completed"  # the whole answer reached the client
    SUPERSEDED = "superseded"  # fenced by a newer generation of its turn
    CLIENT_GONE = "client_gone"  # the client left (or stopped reading) first
    UPSTREAM_ERROR = "upstream_error"  # the upstream failed, or its answer was cut
    REJECTED = "rejected"  # refused by the proxy itself (bad input, no route, no token)
    SHUTDOWN = "shutdown"  # ended by the proxy's own shutdown


class Source(StrEnum):
    """How a request was served (proxy/turn/rule.py decides): `x-streamfence-source`."""

    UPSTREAM = "upstream"  # it started a generation
    BESIDE = "beside"  # it started one beside the turn's running generation, unfenced
    FOLLOWED = "followed"  # it followed a running generation from its start
    RESUMED = "resumed"  # ... from after its Last-Event-ID
    REPLAYED = "replayed"  # it was replayed from a generation that had completed
    REFUSED = ""  # the proxy answered it itself: no upstream, no generation


@dataclass(slots=True)
class Record:
    method: str
    path: str
    upstream: str = "-"
    dialect: str = "-"
    # The caller's x-request-id (or the proxy's own when none came), sent upstream as well.
    request_id: str = ""
    # The upstream's own id for the request (`upstream_request_id`): what the client is
    # given as x-request-id, since SDKs read that header as the provider's id.
    upstream_request_id: str = ""
    turn: str = ""  # short hashed turn key, "" when the request has none
    attempt: int = 0
    status: int = 0
    outcome: Outcome = Outcome.PENDING
    error: str = ""  # an errors.* code when the request failed
    cause: str = ""  # an upstream failure's cause and address (errors.UpstreamError.cause)
    streaming: bool = False
    source: Source = Source.UPSTREAM
    bytes_out: int = 0
    events: int = 0
    dropped: int = 0
    started: float = field(default_factory=time.perf_counter)
    forwarded_at: float | None = None
    upstream_headers_at: float | None = None
    first_byte_at: float | None = None
    finished_at: float | None = None
    superseded_by: int | None = None
    fence_latency: float | None = None  # newer claim -> old upstream closed, seconds
    trace: Any = None  # the request's OpenTelemetry span while tracing is on (proxy/ops/tracing.py)
    model: str = ""  # the model the request named ("" when it named none)
    usage: Usage | None = None  # what its answer reported it cost (proxy/wire/usage.py)

    @property
    def fenced_generation(self) -> bool:
        """This record is the supersede of a generation: its first client's (a follower's
        is the same supersede again)."""
        return self.outcome == "superseded" and self.source == "upstream"

    @property
    def duration(self) -> float:
        return (self.finished_at or time.perf_counter()) - self.started

    @property
    def added_ttfb(self) -> float | None:
        """What the proxy itself added to the time to first byte."""
        if None in (self.forwarded_at, self.upstream_headers_at, self.first_byte_at):
            return None
        before = self.forwarded_at - self.started  # type: ignore[operator]
        after = self.first_byte_at - self.upstream_headers_at  # type: ignore[operator]
        return before + after

    @property
    def ttfb(self) -> float | None:
        return None if self.first_byte_at is None else self.first_byte_at - self.started


# A client served from a generation another request started: a follow, counted and shown.
FOLLOWER_SOURCES = frozenset({Source.FOLLOWED, Source.RESUMED, Source.REPLAYED})
# Where providers put their own request id: OpenAI (and most) x-request-id, Anthropic
# request-id.
UPSTREAM_ID_HEADERS = (b"x-request-id", b"request-id")


def upstream_request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The upstream's own id for a request, from its response headers (names in any case)."""
    found = ""
    for name, value in headers:
        lname = name.lower()
        if lname in UPSTREAM_ID_HEADERS and 0 < len(value) <= 256:
            text = value.decode("latin-1")
            if text.isprintable():
                if lname == UPSTREAM_ID_HEADERS[0]:
                    return text
                found = found or text
    return found
