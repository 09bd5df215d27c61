"""What a generation log says (`genlog`), parsed from Redis's replies: its start (`Start`), its
meta hash (`Meta`), its end (`End`). Pure: no I/O, and no Redis client imported, so that a
generation (proxy.turn) can name its log's end without loading one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from proxy.registry.genlog.timing import DEAD_AFTER


class End(StrEnum):
    """How a generation's log ended: its end marker, and its meta's `ended`."""

    COMPLETED = "completed"  # the upstream's whole answer is in the log
    FAILED = "failed"  # the upstream failed or was cut, or nobody read it (scripts.READERS)
    SUPERSEDED = "superseded"  # a newer generation of the turn fenced it
    LOST = "lost"  # Redis lost the log while it was written (scripts.WRITE): it may be cut

    @classmethod
    def _missing_(cls, value: object) -> End:
        # An end this version does not know (written by a newer process): whatever it
        # means, not an answer this process can vouch for.
        return cls.FAILED


class Start(NamedTuple):
    status: int
    headers: list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Meta:
    body_hash: str
    streaming: bool
    start: Start | None
    ended: End | None  # set once the end marker is written
    events: int  # events published so far
    since_write: float  # seconds since the writer's last stamp (Redis's clock)
    # Seconds since the later of the request, the response headers and the last batch with
    # content (proxy.wire.health: keep-alives do not count), by Redis's clock.
    since_activity: float

    @classmethod
    def parse(cls, now_ms: int, pairs: Sequence[bytes]) -> Meta:
        m = {pairs[i].decode(): pairs[i + 1].decode() for i in range(0, len(pairs) - 1, 2)}
        start = None
        if "status" in m:
            start = Start(int(m["status"]), [tuple(h) for h in json.loads(m["headers"])])
        return cls(
            body_hash=m.get("body", ""),
            streaming=m.get("mode") == "1",
            start=start,
            ended=End(m["ended"]) if "ended" in m else None,
            events=int(m.get("next", 0)),
            since_write=(now_ms - int(m["at"])) / 1000,
            since_activity=(now_ms - int(m["last"])) / 1000,
        )

    @property
    def writer_alive(self) -> bool:
        return self.ended is not None or self.since_write <= DEAD_AFTER


class Current(NamedTuple):
    token: int
    attempt: int
    meta: Meta | None  # None: the holder publishes no log (or it expired)
