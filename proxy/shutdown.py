"""Graceful shutdown: on SIGTERM (or Ctrl-C) uvicorn stops accepting connections and waits
for the running requests; after `[server] shutdown_grace` seconds the streams still running
are ended with an error event in their own dialect (`Relay.abort`), not cut mid-event.

uvicorn owns the signals (it installs its handlers around the whole serve, lifespan
included), so the lifespan chains onto its handler rather than replacing it: uvicorn still
does the stopping, and this module only adds the deadline. uvicorn's own hard timeout is set
a little later (`uvicorn_timeout`), leaving time for the error events to be written.
"""

from __future__ import annotations

import asyncio
import math
import signal
import threading
from collections.abc import Callable, Collection
from types import FrameType
from typing import Any, Protocol

from proxy.errors import ShuttingDown

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seconds between our deadline and uvicorn cancelling whatever still runs.
UVICORN_MARGIN = 3.0
MESSAGE = (
    "streamfence: the proxy is shutting down and ended this request before it finished; "
    "send it again"
)

Handler = Callable[[int, FrameType | None], Any] | int | None


class Abortable(Protocol):
    def abort(self, error: ShuttingDown) -> None: ...


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
            self.abort_all()
            return
        self.stopping = True
        self._timer = self._loop.call_later(self.grace, self.abort_all)

    def abort_all(self) -> None:
        error = ShuttingDown(MESSAGE)
        for relay in list(self.active):
            relay.abort(error)
