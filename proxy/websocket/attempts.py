"""The responses of a Responses WebSocket, as the fence (proxy/websocket/fence.py) tracks
them: one `ResponseAttempt` per response.create, the newest one of each turn process-wide
(`TwinTable`), and the twin rule that decides whether an identical one goes beside it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from proxy.config.schema import OnRetry
from proxy.errors import StreamfenceError
from proxy.ops.record import Record
from proxy.registry import Lease
from proxy.turn import rule
from proxy.websocket.types import Data
from proxy.wire.usage import Usage


class Owner(Protocol):
    """The fence an attempt belongs to."""

    def abort(self, attempt: ResponseAttempt, error: StreamfenceError) -> None: ...


def twin_beside(identical: bool, healthy: bool, on_retry: OnRetry) -> bool:
    """A response.create goes beside its running twin where an HTTP request would follow it
    (the follow rule, proxy/turn/rule.py `retry`, on the clock HTTP generations are judged
    by): a socket cannot follow, its session is stateful upstream."""
    return rule.retry(identical, True, healthy, on_retry) is rule.Action.FOLLOW


@dataclass(eq=False)
class ResponseAttempt:
    """One response.create: what the status page, shutdown and metrics see of it."""

    record: Record
    message: Data
    lane: str | None
    lease: Lease | None = None
    body_fp: str | None = None
    started: bool = False  # the upstream sent at least one event of it
    fenced: bool = False
    done: bool = False
    last_event: str | None = None
    # The later of the request and its last content event (time.monotonic): its health
    # (proxy.wire.health), by the rule HTTP generations follow. Keep-alives do not move it.
    alive_at: float = field(default_factory=time.monotonic)
    owner: Owner | None = None

    def last_alive(self) -> float | None:
        """Its last sign of life, for the status page: a keyed response has a twin rule."""
        return None if self.lease is None else self.alive_at

    def usage(self) -> Usage | None:
        """Known at its end (response.completed), when its record is no longer shown."""
        return self.record.usage

    def abort(self, error: StreamfenceError) -> None:
        """Shutdown: this response ends with `error`, then the socket closes (1001)."""
        if self.owner is not None and not self.done:
            self.owner.abort(self, error)


class TwinTable:
    """The newest attempt per turn key, process-wide: an identical request arriving while
    it is healthy is forwarded beside it instead of superseding it (on_retry adaptive/join)."""

    def __init__(self) -> None:
        self.current: dict[str, ResponseAttempt] = {}

    def running(self, key: str) -> ResponseAttempt | None:
        found = self.current.get(key)
        return found if found is not None and not found.done and not found.fenced else None

    def discard(self, key: str, attempt: ResponseAttempt) -> None:
        if self.current.get(key) is attempt:
            del self.current[key]
