"""uvicorn's HTTP protocol, each request's first step taken in the callback that read it.

uvicorn starts a request's ASGI task from inside its parser, and a task's first step runs
at the event loop's next iteration. That first step is where a newer attempt of a turn
fences the old one (the memory registry's claim, the old upstream shut down at once), so
the fence waited behind everything else ready in that iteration: under load (bench B5),
an iteration of relaying, milliseconds. Here the step runs as soon as the bytes that
completed the request are parsed, still inside `data_received`; the task uvicorn keeps
runs the rest (`tasks.start_eagerly`). With the accept, a fence takes two iterations of
the loop where it took four.

Each request's scope also carries the `writes.CUT` extension: how the relay ends a body the
upstream cut mid-way without its last chunk (`cut`, given the server's `send`). A function of
the module, not one bound to the request: a scope that referred to its own cycle would be a
reference cycle per request, for the garbage collector (a percent of a short request).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from proxy.tasks import start_eagerly
from proxy.turn.writes import CUT


class Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (`serve.uvicorn_options`:
    http="proxy.server.eager:Protocol")."""

    _steps: list[Callable[[], None]] | None = None  # set while a read is parsed

    def data_received(self, data: bytes) -> None:
        steps: list[Callable[[], None]] = []
        self._steps = steps
        try:
            super().data_received(data)
        finally:
            self._steps = None
        for step in steps:
            step()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        scope = cast(dict[str, Any], cycle.scope)
        scope["extensions"] = {CUT: cut}  # uvicorn's HTTP scope has no extensions of its own
        steps = self._steps
        if steps is None or asyncio.current_task(self.loop) is not None:
            super()._start_asgi_task(cycle, app)  # e.g. a pipelined request, started later
            return
        reset = self.config.reset_contextvars
        context = contextvars.Context() if reset else contextvars.copy_context()
        task, step = start_eagerly(self.loop, cycle.run_asgi(app), context)
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        steps.append(step)


def cut(send: Callable[..., Any]) -> None:
    """End the response that `send` (uvicorn's, as the app got it) writes where it stands:
    what was written goes out, then the connection closes without the chunked terminator
    (curl: exit 18, "transfer closed with outstanding read data remaining"; httpx:
    RemoteProtocolError), as when a server dies mid-body. Marked disconnected first, so that
    uvicorn neither writes more nor reports an application that "returned without completing
    response". A `send` wrapped by middleware is left alone: the response is left unfinished,
    which ends it the same way."""
    cycle = getattr(send, "__self__", None)
    if not isinstance(cycle, RequestResponseCycle):
        return
    try:  # uvicorn's cycle, private: a uvicorn without these leaves the response unfinished
        if cycle.response_complete or cycle.disconnected:
            return
        cycle.disconnected = True
        cycle.keep_alive = False
        cycle.message_event.set()  # a receive() waiting now answers http.disconnect
        cycle.transport.close()  # after the buffered writes, FIN: never a terminator
    except AttributeError:
        return
