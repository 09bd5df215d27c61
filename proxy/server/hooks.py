"""The private internals the fast path builds on, each checked once at startup, each with a
floor under it: where one is missing (a uvicorn, uvloop or Python newer than the ones tested
and pinned in pyproject.toml), the proxy takes the plain path instead and says so in one
startup line. Nothing is ever assumed at request time.

- asyncio's `_enter_task` / `_leave_task` and uvicorn's `HttpToolsProtocol._start_asgi_task`
  (with the request cycle's `run_asgi`): a request's first step taken in the read that
  completed it (proxy/server/eager.py). Without them: uvicorn's own httptools protocol, where
  a fence waits one loop iteration longer and a body the upstream cut is ended by uvicorn
  (an error line in its log) instead of by the relay (proxy/turn/writes.py `cut`).
- The listening socket's `_accept` (the C socket's, without socket.accept()'s enum
  conversions): every pending connection taken at a wake-up (proxy/server/listen.py). Without
  it: uvloop's own server, one accept per loop iteration.
"""

from __future__ import annotations

import inspect
import socket
from typing import Final

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from proxy import tasks

EAGER_PROTOCOL: Final = "proxy.server.eager:Protocol"
PLAIN_PROTOCOL: Final = "httptools"


def eager_missing() -> str | None:
    """Why a request's first step cannot be taken in its read on this Python and uvicorn;
    None when it can."""
    if not tasks.eager_steps():
        return "asyncio has no _enter_task/_leave_task"
    start = getattr(HttpToolsProtocol, "_start_asgi_task", None)
    if not callable(start):
        return "uvicorn's HttpToolsProtocol has no _start_asgi_task"
    if list(inspect.signature(start).parameters) != ["self", "cycle", "app"]:
        return "uvicorn's HttpToolsProtocol._start_asgi_task takes other arguments"
    if not callable(getattr(RequestResponseCycle, "run_asgi", None)):
        return "uvicorn's RequestResponseCycle has no run_asgi"
    return None


def http_protocol() -> str:
    """What uvicorn runs each connection with: ours where its hooks exist, else its own."""
    return EAGER_PROTOCOL if eager_missing() is None else PLAIN_PROTOCOL


def accept_missing() -> str | None:
    """Why listening sockets cannot be drained at each wake-up; None when they can."""
    if not callable(getattr(socket.socket, "_accept", None)):
        return "socket.socket has no _accept"
    return None


def startup_warnings() -> list[str]:
    """One line per hook missing, for the startup lines."""
    lines = []
    reason = eager_missing()
    if reason is not None:
        lines.append(
            f"WARNING: {reason}: requests start a loop iteration later (uvicorn's own HTTP "
            "protocol), so a fence waits longer under load"
        )
    reason = accept_missing()
    if reason is not None:
        lines.append(
            f"WARNING: {reason}: uvloop accepts one connection per loop iteration, so under "
            "load new requests wait longer to be seen"
        )
    return lines
