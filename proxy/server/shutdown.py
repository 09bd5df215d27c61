"""Graceful shutdown: on SIGTERM (or Ctrl-C) uvicorn stops accepting connections and waits
for the running requests; after `[server] shutdown_grace` seconds the streams still running
are ended with an error event in their own dialect (`Relay.abort`), not cut mid-event.

uvicorn owns the signals (it installs its handlers around the whole serve, lifespan
included), so the lifespan chains onto its handler rather than replacing it: uvicorn still
does the stopping, and this module only adds the deadline. uvicorn's own hard timeout is set
a little later (`uvicorn_timeout`), leaving time for the error events to be written.

Two log lines frame a shutdown: one when it starts (what is in flight, the grace it waits)
and one when it ends (how long it took, what it had to end), so that a stop that waits is
never a silent one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Collection
from types import FrameType
from typing import Any

from proxy.errors import ShuttingDown
from proxy.runtime import Abortable

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seconds between our deadline and uvicorn cancelling whatever still runs.
UVICORN_MARGIN = 3.0
MESSAGE = (
    "streamfence: the proxy is shutting down and ended this request before it finished; "
    "send it again"
)

Handler = Callable[[int, FrameType | None], Any] | int | None
log = logging.getLogger("streamfence.shutdown")


def _requests(n: int) -> str:
    return f"{n} request{'' if n == 1 else 's'}"


def starting_line(in_flight: int, grace: float) -> str:
    if not in_flight:
        return "shutting down: nothing in flight, stopping now"
    return (
        f"shutting down: {_requests(in_flight)} in flight; waiting up to {grace:g} s for "
        "them to finish, then each gets an error event (a second signal ends them now)"
    )


def ended_line(seconds: float, in_flight: int, ended: int) -> str:
    """`in_flight`: when the shutdown began; `ended`: by the shutdown, with an error event."""
    if ended:
        return f"stopped after {seconds:.1f} s: {_requests(ended)} ended by the shutdown"
    if in_flight:
        return f"stopped after {seconds:.1f} s: every request in flight finished"
    return f"stopped after {seconds:.1f} s"


def uvicorn_timeout(grace: float) -> int:
    """uvicorn's timeout_graceful_shutdown for a given grace period."""
    return math.ceil(grace + UVICORN_MARGIN)


def exit_cleanly(signum: int, frame: FrameType | None) -> None:
    """The process's own SIGTERM handler, outside uvicorn's: after a graceful shutdown
    uvicorn re-raises the signal it caught, and a supervisor should see exit status 0,
    not "killed by SIGTERM". Before uvicorn runs, it simply exits."""
    raise SystemExit(0)


class Drain:
    """Ends the streams in `active` that are still running `grace` seconds after the
    first stop signal; a second signal ends them at once."""

    def __init__(self, active: Collection[Abortable], grace: float) -> None:
        self.active = active
        self.grace = grace
        self.stopping = False
        self._began_at = 0.0
        self._in_flight = 0  # when the shutdown began
        self._ended: set[int] = set()  # the requests this shutdown ended, by id
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._installed: dict[int, tuple[Handler, Callable[[int, FrameType | None], None]]] = {}

    def install(self) -> None:
        """From the app's lifespan startup, when uvicorn's handlers are already in place."""
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only; nothing to chain onto
        self._loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            previous = signal.getsignal(sig)
            handler = self._chained(previous)
            signal.signal(sig, handler)
            self._installed[sig] = (previous, handler)

    def uninstall(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, (previous, handler) in self._installed.items():
            if signal.getsignal(sig) is handler:  # leave a later handler alone
                signal.signal(sig, previous)
        self._installed.clear()

    def _chained(self, previous: Handler) -> Callable[[int, FrameType | None], None]:
        def handle(signum: int, frame: FrameType | None) -> None:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self.begin)
            if callable(previous):
                previous(signum, frame)

        return handle

    def begin(self) -> None:
        assert self._loop is not None
        if self.stopping:
            if self.active:
                log.info(f"shutting down now: ending {_requests(len(self.active))} in flight")
            self.abort_all()
            return
        self.stopping = True
        self._began_at, self._in_flight = time.monotonic(), len(self.active)
        log.info(starting_line(self._in_flight, self.grace))
        self._timer = self._loop.call_later(self.grace, self.abort_all)

    def abort_all(self) -> None:
        error = ShuttingDown(MESSAGE)
        for relay in list(self.active):
            self._ended.add(id(relay))
            relay.abort(error)

    def report_end(self) -> None:
        """The shutdown's last line, from the lifespan's end: every connection is closed."""
        if self.stopping:
            seconds = time.monotonic() - self._began_at
            log.info(ended_line(seconds, self._in_flight, len(self._ended)))
