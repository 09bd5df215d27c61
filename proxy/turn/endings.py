"""How a client's request ends (proxy/turn/relay.py): the cause a cancellation records where
it happens, what that cancellation interrupts, and the outcome each ending is logged and
counted as. Pure."""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from proxy.errors import StreamfenceError
from proxy.ops.record import Outcome


class Cause(StrEnum):
    """Why a cancellation ended a client: recorded once, where the cancellation happens."""

    SUPERSEDED = "superseded"
    SHUTDOWN = "shutdown"
    CLIENT_GONE = "gone"
    WRITE_TIMEOUT = "timeout"


class Reach(StrEnum):
    """What a cancellation interrupts: the fence only the serving of events (the client then
    gets its frame), the race everything (nothing more can reach the client)."""

    FENCE = "fence"
    RACE = "race"


# Bound once, as the rule's actions are (proxy/turn/rule.py): this runs for every request.
_TIMEOUT, _COMPLETED, _GONE, _FAILED = (
    Cause.WRITE_TIMEOUT,
    Outcome.COMPLETED,
    Outcome.CLIENT_GONE,
    Outcome.UPSTREAM_ERROR,
)
_BY_CAUSE: Final = {
    Cause.SUPERSEDED: Outcome.SUPERSEDED,
    Cause.SHUTDOWN: Outcome.SHUTDOWN,
    Cause.CLIENT_GONE: Outcome.CLIENT_GONE,
}


def ending(
    cause: Cause | None, delivered: bool, error: StreamfenceError | None
) -> tuple[Outcome, str]:
    """How a client's request ended, from the cause recorded when it was cancelled, and the
    error code that says so where the cause is one (a write timeout counts even after the
    last event: the client took nothing)."""
    if cause is _TIMEOUT:
        return _GONE, "client_write_timeout"
    if delivered:
        return _COMPLETED, ""
    by_cause = _BY_CAUSE.get(cause) if cause is not None else None
    if by_cause is not None:
        return by_cause, ""
    return (_GONE if error is None else _FAILED), ""
