"""The one log line per finished request, and the record it is made from.

Never a credential or a body: the record has no field that could hold one. Turn keys are
already hashes; only their first 16 hex digits are shown.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, fields

logger = logging.getLogger("streamfence")


@dataclass(slots=True)
class Record:
    method: str
    path: str
    upstream: str = "-"
    dialect: str = "-"
    request_id: str = ""
    turn: str = ""  # short hashed turn key, "" when the request has none
    attempt: int = 0
    status: int = 0
    outcome: str = "pending"  # completed | superseded | client_gone | upstream_error | rejected
    # | shutdown
    error: str = ""  # an errors.* code when the request failed
    streaming: bool = False
    source: str = "upstream"  # upstream | beside | followed | resumed | replayed (proxy/follow.py)
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


# The raw clock readings are logged as the durations derived from them.
_CLOCKS = {"started", "forwarded_at", "upstream_headers_at", "first_byte_at", "finished_at"}
_LOGGED = tuple(f.name for f in fields(Record) if f.name not in _CLOCKS | {"fence_latency"})


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def line(record: Record, fmt: str = "json") -> str:
    # Every field is a plain value: read them directly (asdict deep-copies, per request).
    data: dict[str, object] = {name: getattr(record, name) for name in _LOGGED}
    data.update(
        ttfb_ms=_ms(record.ttfb),
        duration_ms=_ms(record.duration),
        fence_latency_ms=_ms(record.fence_latency),
    )
    stamped = {"ts": round(time.time(), 3), "msg": "request", **data}
    if fmt == "text":
        return _text(stamped)
    return json.dumps(stamped)


def _text(data: dict[str, object]) -> str:
    # For humans: an ISO time first, empty fields left out, values with spaces quoted.
    ts = data.pop("ts")
    assert isinstance(ts, float)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"
    shown = [f"{k}={_quote(v)}" for k, v in data.items() if v not in (None, "", False)]
    return " ".join([stamp, *shown])


def _quote(value: object) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c in text for c in ' "=') else text


def log_request(record: Record, fmt: str = "json") -> None:
    if logger.isEnabledFor(logging.INFO):
        logger.info(line(record, fmt))


def supersede_line(record: Record, fmt: str = "json") -> str:
    """Both attempts of a supersede, and how long the fence took to close the old one."""
    data: dict[str, object] = {
        "ts": round(time.time(), 3),
        "msg": "superseded",
        "turn": record.turn,
        "attempt": record.attempt,
        "by_attempt": record.superseded_by,
        "upstream": record.upstream,
        "request_id": record.request_id,
        "fence_latency_ms": _ms(record.fence_latency),
    }
    if fmt == "text":
        return _text(data)
    return json.dumps(data)


def log_supersede(record: Record, fmt: str = "json") -> None:
    if logger.isEnabledFor(logging.INFO):
        logger.info(supersede_line(record, fmt))
