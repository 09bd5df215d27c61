"""The relay: the one place that writes to a client, and where the race lives.

One task group per request races three things:

    upstream events  ->  fence check  ->  client write
    lease superseded ->  close upstream, write the dialect's superseded frame (or 409)
    client gone      ->  close upstream

The supersede signal cancels the `fence` scope directly (a callback on the lease), so a
fenced attempt stops at its next await, and its upstream is closed, not drained, before
anything else happens. Every exit path runs the same `finally`: upstream closed, lease
released, one record observed. A non-SSE response is fenced only until its headers are
sent (CONTRACT section 2): after that the upstream has done its work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from proxy import dialects, upstream
from proxy.errors import StreamfenceError, Superseded
from proxy.logs import Record
from proxy.registry import Lease, Registry
from proxy.routing import response_headers
from proxy.turns import TurnKey
from proxy.upstream import UpstreamClient

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]

SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


@dataclass(slots=True)
class Exchange:
    """Everything the relay needs to know about one accepted request."""

    request: httpx.Request
    upstream_name: str
    dialect: str
    turn: TurnKey | None
    max_event_bytes: int
    extra_headers: list[tuple[bytes, bytes]]
    write_timeout: float = 0.0  # seconds one client write may block; 0: no limit


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


class _WriteGuard:
    """Calls `expire` once a client write has stayed blocked for `timeout` seconds.

    One timer per relay, re-armed lazily, not one per write: a relayed event is one write,
    and nearly every write returns without blocking."""

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


class Relay:
    """An ASGI response: forwards one exchange and relays its answer under the fence."""

    def __init__(
        self,
        exchange: Exchange,
        client: UpstreamClient,
        registry: Registry | None,
        record: Record,
        on_finish: Callable[[Record, StreamfenceError | None], None],
    ) -> None:
        self.ex = exchange
        self.client = client
        self.registry = registry
        self.record = record
        self.on_finish = on_finish
        self.lease: Lease | None = None
        self.response: httpx.Response | None = None
        self.headers_sent = False
        self.completed = False
        self.client_gone = False
        self.error: StreamfenceError | None = None
        self.last_event: bytes | None = None
        self.done = False  # the response is complete: a disconnect now is not the client leaving
        self.abort_error: StreamfenceError | None = None
        self._fence: anyio.CancelScope | None = None
        self._write_guard: _WriteGuard | None = None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope)
                send = self._bounded(send, tg.cancel_scope)
                await self._run(send)
                if self.headers_sent:
                    # Inside the race: a client that never takes this last write is dropped
                    # by the write timeout like any other (uvicorn's send returns without
                    # suspending once it has written, so `done` is set before the watcher
                    # can see the finished response as a disconnect).
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                self.done = True
                tg.cancel_scope.cancel()
        finally:
            if self._write_guard is not None:
                self._write_guard.disarm()
            with anyio.CancelScope(shield=True):
                await self._close_upstream()
                await self._finish()

    async def _watch_disconnect(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.done:
            self.client_gone = True
            scope.cancel()

    def _bounded(self, send: Send, scope: anyio.CancelScope) -> Send:
        """`send`, but a client that keeps one write blocked for write_timeout seconds is
        dropped like one that left. While a write is blocked (uvicorn's flow control) the
        relay reads nothing more from the upstream, so memory stays bounded; this caps how
        long the upstream is held open for a client that does not read."""
        timeout = self.ex.write_timeout
        if not timeout:
            return send

        def expire() -> None:
            self.client_gone = True
            self.record.error = "client_write_timeout"
            scope.cancel()  # the blocked send, and the race, end here

        guard = self._write_guard = _WriteGuard(timeout, expire)

        async def send_or_drop(message: Message) -> None:
            guard.blocked_since = guard.loop.time()
            guard.arm()
            try:
                await send(message)
            finally:
                guard.blocked_since = None

        return send_or_drop

    def abort(self, error: StreamfenceError) -> None:
        """End this stream with `error` (shutdown). Like a supersede, it stops the relay at
        its next await; a non-SSE body already under way is left to finish."""
        self.abort_error = error
        if self._fence is not None:
            self._fence.cancel()

    async def _run(self, send: Send) -> None:
        with anyio.CancelScope() as fence:
            self._fence = fence
            if self.abort_error is not None:
                fence.cancel()
            try:
                await self._claim(fence)
                await self._open()
                if self._is_sse():
                    await self._relay_events(send)
            except StreamfenceError as exc:
                self.error = exc
        self._fence = None
        if fence.cancel_called and not self.completed:
            await self._close_upstream()  # first: the fence's promise is a closed upstream
            if self.abort_error is not None:
                self.error = self.abort_error
                await self._end_with_error(send, self.abort_error)
            else:
                assert self.lease is not None and self.lease.superseded_at is not None
                self.record.fence_latency = time.perf_counter() - self.lease.superseded_at
                await self._end_superseded(send)
        elif self.error is not None:
            await self._end_with_error(send, self.error)
        elif not self.completed:
            await self._pass_through(send)  # not SSE: past the fence once headers go out

    async def _claim(self, fence: anyio.CancelScope) -> None:
        # Claimed here, inside the race, so that a client gone during a slow claim (Redis)
        # and a registry failure (errors.RegistryUnavailable) take the same paths as the rest.
        if self.registry is None or self.ex.turn is None:
            return
        self.lease = await self.registry.claim(self.ex.turn.key)
        self.record.attempt = self.lease.attempt
        self.lease.on_superseded(fence.cancel)

    async def _open(self) -> None:
        self.record.forwarded_at = time.perf_counter()
        self.response = await self.client.send(self.ex.request, self.ex.upstream_name)
        self.record.upstream_headers_at = time.perf_counter()
        self.record.status = self.response.status_code

    def _is_sse(self) -> bool:
        assert self.response is not None
        return upstream.is_event_stream(self.response)

    async def _start(self, send: Send, *, reframed: bool) -> None:
        assert self.response is not None
        headers = response_headers(self.response.headers.raw, reframed=reframed)
        headers += self._own_headers()
        if reframed:
            headers += SSE_HEADERS
        await send(
            {"type": "http.response.start", "status": self.response.status_code, "headers": headers}
        )
        self.headers_sent = True
        self.record.first_byte_at = time.perf_counter()

    async def _relay_events(self, send: Send) -> None:
        assert self.response is not None
        self.record.streaming = True
        await self._start(send, reframed=True)
        self.completed = await upstream.read_events(
            self.response,
            self.ex.upstream_name,
            self.ex.max_event_bytes,
            lambda events: self._deliver(send, events),
        )

    async def _deliver(self, send: Send, events: list[bytes]) -> bool:
        """The fence check, then the write; False when fenced (the events are dropped).

        Nothing awaits between the check and the write, so the check holds for every
        event of the batch: one write, all of it checked at one instant."""
        lease = self.lease
        if lease is not None and lease.superseded_at is not None:
            self.record.dropped += len(events)
            return False
        await self._write(send, events)
        return True

    async def _write(self, send: Send, events: list[bytes]) -> None:
        body = events[0] if len(events) == 1 else b"".join(events)
        await send({"type": "http.response.body", "body": body, "more_body": True})
        self.record.events += len(events)
        self.record.bytes_out += len(body)
        self.last_event = events[-1]

    async def _pass_through(self, send: Send) -> None:
        assert self.response is not None
        await self._start(send, reframed=False)
        with upstream.translate_errors(self.ex.upstream_name):
            async for chunk in self.response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.record.bytes_out += len(chunk)
        self.completed = True

    async def _end_superseded(self, send: Send) -> None:
        assert self.lease is not None
        error = Superseded(self.lease.attempt, self.lease.newer_attempt)
        self.record.outcome = "superseded"
        self.record.superseded_by = self.lease.newer_attempt
        await self._end_with_error(send, error)

    async def _end_with_error(self, send: Send, error: StreamfenceError) -> None:
        self.record.error = error.code
        if self.headers_sent:
            frame = dialects.stream_error_frame(self.ex.dialect, error, self.last_event)
            await send({"type": "http.response.body", "body": frame, "more_body": True})
            return
        start, body = error_response_parts(error, self.ex.dialect, self._own_headers())
        self.record.status = error.status
        await send(start)
        self.headers_sent = True
        self.record.first_byte_at = time.perf_counter()
        await send(body)
        self.headers_sent = False  # the body above already ended the response

    def _own_headers(self) -> list[tuple[bytes, bytes]]:
        """What the caller is told about its turn: the hashed key and the attempt number."""
        headers = list(self.ex.extra_headers)
        if self.ex.turn is not None:
            headers.append((b"x-streamfence-turn", self.ex.turn.short.encode()))
        if self.lease is not None:
            headers.append((b"x-streamfence-attempt", str(self.lease.attempt).encode()))
        return headers

    async def _close_upstream(self) -> None:
        # Closing an unfinished httpx response closes its connection: nothing is drained.
        if self.response is not None:
            with anyio.CancelScope(shield=True):
                await self.response.aclose()
            self.response = None

    async def _finish(self) -> None:
        record = self.record
        if record.outcome == "pending":
            if self.client_gone:
                record.outcome = "client_gone"
            elif self.completed:
                record.outcome = "completed"
            elif self.error is not None:
                record.outcome = "upstream_error"
            else:
                record.outcome = "client_gone"
        record.finished_at = time.perf_counter()
        if self.lease is not None and self.registry is not None:
            await self.registry.release(self.lease)
        self.on_finish(record, self.error)
