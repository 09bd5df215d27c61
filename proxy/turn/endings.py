"""How a client's request ends (proxy/turn/relay.py): the cause a cancellation records where
it happens, what that cancellation interrupts, and the outcome each ending is logged and
counted as. Pure."""

from __future__ import annotations

from enum import StrEnum

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


def outcome(cause: Cause | None, delivered: bool, error: StreamfenceError | None) -> Outcome:
    """How a client's request ended, from the cause recorded when it was cancelled."""
    if cause is Cause.WRITE_TIMEOUT:
        return Outcome.CLIENT_GONE
    if delivered:
        return Outcome.COMPLETED
    if cause is Cause.SUPERSEDED:
        return Outcome.SUPERSEDED
    if cause is Cause.SHUTDOWN:
        return Outcome.SHUTDOWN
    if cause is Cause.CLIENT_GONE or error is None:
        return Outcome.CLIENT_GONE
    return Outcome.UPSTREAM_ERROR
