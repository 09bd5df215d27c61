"""A client's side of a request, beside the answer itself: what it is told about its turn
(`Exchange`, its own headers), the ASGI messages of an error response in its dialect, and
how long one write to it may stay blocked before it is dropped like a client that left.

The relay (`proxy.turn.relay`) and the endpoint (`proxy.server.endpoint`) write to clients
through these.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.asgi import Headers, Message, Send
from proxy.errors import StreamfenceError
from proxy.ops.record import Source
from proxy.upstream.routing import response_headers
from proxy.wire import dialects

SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]

# A scope extension (`scope["extensions"][CUT]`, called with the server's own `send`) that
# ends a response whose body has begun without its last chunk: the connection closes after
# what was written, as a server cut off mid-body would (proxy.server.eager provides it). ASGI has no
# message for that; without it a response left unfinished ends the same way, with the
# server's complaint in the log.
CUT = "streamfence.cut"


@dataclass(slots=True)
class Exchange:
    """What a subscriber needs to know about its request, beyond its generation."""

    dialect: str
    turn_short: str  # "" when the request has no turn key
    source: Source  # how it was served (x-streamfence-source)
    went_upstream: bool  # it started the generation it reads (not a follower)
    cursor: int  # start after this event number of the generation
    extra_headers: list[tuple[bytes, bytes]]
    write_timeout: float = 0.0  # seconds one client write may block; 0: no limit

    def own_headers(self, attempt: int | None) -> list[tuple[bytes, bytes]]:
        """What the caller is told about its turn: hashed key, attempt, how it was served."""
        headers = list(self.extra_headers)
        if self.turn_short:
            headers.append((b"x-streamfence-turn", self.turn_short.encode()))
            headers.append((b"x-streamfence-source", self.source.encode()))
        if attempt is not None:
            headers.append((b"x-streamfence-attempt", str(attempt).encode()))
        return headers


def cut(scope: Message, send: Send) -> None:
    """End the response `send` writes without its last chunk (`CUT`). Under a server without
    the extension the response is left unfinished, which ends it the same way."""
    end = scope.get("extensions", {}).get(CUT)
    if end is not None:
        end(send)


def response_start(status: int, upstream: Headers, own: Headers, reframed: bool) -> Message:
    """The head of a response from upstream: its headers as they came (less hop-by-hop ones
    and, `reframed`, its framing: proxy/upstream/routing.py), then the client's own ones that
    the upstream did not send (its request id wins: it is the one a caller reports)."""
    headers = response_headers(upstream, reframed=reframed)
    upstream_names = {name for name, _ in headers}
    headers += [h for h in own if h[0] not in upstream_names]
    if reframed:
        headers += SSE_HEADERS
    return {"type": "http.response.start", "status": status, "headers": headers}


def error_response_parts(
    error: StreamfenceError, dialect: str, extra: Sequence[tuple[bytes, bytes]] = ()
) -> tuple[Message, Message]:
    """The two ASGI messages of an error response in the caller's dialect."""
    body = dialects.error_body(dialect, error)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    if not error.retryable:
        # The official SDKs retry 409 and 5xx unless told not to; a retried fenced
        # request would fence the winner.
        headers.append((b"x-should-retry", b"false"))
    return (
        {"type": "http.response.start", "status": error.status, "headers": headers},
        {"type": "http.response.body", "body": body, "more_body": False},
    )


class WriteGuard:
    """Calls `expire` once a client write has stayed blocked for `timeout` seconds.

    One timer per client, re-armed lazily, not one per write: a relayed event is one
    write, and nearly every write returns without blocking."""

    __slots__ = ("_expire", "_timeout", "_timer", "blocked_since", "loop")

    def __init__(self, timeout: float, expire: Callable[[], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self._timeout = timeout
        self._expire = expire
        self._timer: asyncio.TimerHandle | None = None
        self.blocked_since: float | None = None  # loop time a write began, None between

    def arm(self) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(self._timeout, self._check)

    def _check(self) -> None:
        self._timer = None
        if self.blocked_since is None:
            return  # no write under way: the next write arms a new timer
        left = self.blocked_since + self._timeout - self.loop.time()
        if left <= 0:
            self._expire()
        else:
            self._timer = self.loop.call_later(left, self._check)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def bound(self, send: Send) -> Send:
        """`send`, watched: a write blocked for the timeout calls `expire`."""

        async def send_or_drop(message: Message) -> None:
            self.blocked_since = self.loop.time()
            self.arm()
            try:
                await send(message)
            finally:
                self.blocked_since = None

        return send_or_drop
