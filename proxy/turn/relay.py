"""The relay: one client's subscription to a generation, the one place that writes to a
client, and where the race lives.

One task group per client races three things:

    generation events  ->  fence check  ->  client write
    generation fenced  ->  (its upstream already closing) the dialect's superseded frame, or 409
    client gone        ->  leave the generation (the last client closes its upstream)

A client that went upstream and a follower of the same generation are the same thing here:
a cursor into the generation's buffer, its own disconnect watch and its own write timeout.
The ending cause is recorded once, at the moment of the cancellation that causes it
(`_stop`), never inferred afterwards. A non-SSE response is fenced only until its headers
are sent (CONTRACT section 2): after that the upstream has done its work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from proxy.asgi import Message, Receive, Send
from proxy.errors import StreamfenceError, Superseded, UpstreamError, kept
from proxy.ops.record import Outcome, Record, Source
from proxy.registry import Lease
from proxy.tasks import run_now
from proxy.turn.endings import Cause, Reach, ending
from proxy.turn.generation import Generation
from proxy.turn.writes import Exchange, WriteGuard, cut, error_response_parts, response_start
from proxy.wire import dialects
from proxy.wire.usage import Usage

_PENDING = Outcome.PENDING  # bound once: see proxy/turn/rule.py NEW
# The largest last write that also ends the response: under the transport's high-water mark
# (uvicorn's and uvloop's 64 KiB), so that it cannot leave the transport paused unseen.
END_WITH_LAST_MAX = 16 * 1024


class Subscriber:
    """An ASGI response: one client of one generation, under the generation's fence."""

    def __init__(
        self,
        generation: Generation,
        exchange: Exchange,
        record: Record,
        on_finish: Callable[[Record, StreamfenceError | None], None],
    ) -> None:
        self.gen = generation
        self.ex = exchange
        self.record = record
        self.on_finish = on_finish
        self.cause: Cause | None = None  # why a cancellation ended this client, set once
        self.error: StreamfenceError | None = None  # an upstream failure, or shutdown
        self.headers_sent = False
        self.delivered = False  # the whole answer (or its terminator) was written
        self.done = False  # the response is complete: a disconnect now is no client leaving
        self.ended = False  # its body was ended with the stream's last events
        self.cut = False  # its body is to end without its terminator (errors.cuts_body)
        self.last_event: bytes | None = None
        self._task: asyncio.Task[Any] | None = None  # the response's task, once it runs
        self._cancels = 0  # cancellations of that task requested by _stop
        self._fencing = False  # serving events: a fence cancellation interrupts it
        self._raced = False  # a race cancellation was requested: nothing may swallow it
        self._guard: WriteGuard | None = None
        self._send: Send | None = None
        self.cursor = exchange.cursor  # the number of the last event written
        self.parked = False  # waiting in the generation, caught up (it may write for us)
        self._inline = False  # the generation's reader is writing for this client
        self._inline_over: asyncio.Future[None] | None = None  # someone waits for that write
        generation.attach(self)  # now: no await before the race owns it

    @property
    def lease(self) -> Lease | None:
        return self.gen.lease

    def last_alive(self) -> float:
        """Its generation's last sign of life: what a retry of it is judged by."""
        return self.gen.last_alive()

    def usage(self) -> Usage | None:
        return self.gen.meter.usage

    # -- cancellations: each records its cause once ----------------------------------------
    def _stop(self, cause: Cause, reach: Reach) -> None:
        """Record `cause` (the first one wins) and cancel the task as far as `reach`.

        The task cancels itself and later absorbs exactly the cancellations it requested
        (`_absorbed`), so a cancellation from anywhere else (a server shutting down) still
        propagates. A fence outside the serving of events has nothing left to interrupt."""
        if self.cause is None:
            self.cause = cause
        if reach is Reach.RACE:
            self._raced = True
        elif not self._fencing:
            return
        if self._task is not None:
            self._cancels += 1
            self._task.cancel()

    def _absorbed(self) -> bool:
        """After a CancelledError: True when every cancellation pending was one of ours."""
        assert self._task is not None
        left = self._task.cancelling()
        for _ in range(self._cancels):
            left = self._task.uncancel()
        self._cancels = 0
        return left == 0

    def superseded(self) -> None:
        """The generation was fenced by a newer one (called by the generation)."""
        self._stop(Cause.SUPERSEDED, Reach.FENCE)

    def abort(self, error: StreamfenceError) -> None:
        """End this client with `error` (shutdown), at its next await, with the dialect's
        error frame; a non-SSE body already under way is left to finish."""
        if self.cause is None and not self.delivered:
            self.error = error
        self._stop(Cause.SHUTDOWN, Reach.FENCE)

    # -- the race ---------------------------------------------------------------------------
    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        # The race is this task and its disconnect watch, in plain asyncio: anyio's task
        # group and cancel scopes cost a sixth of the CPU of a short request.
        self._task = asyncio.current_task()
        watch = asyncio.get_running_loop().create_task(self._watch_disconnect(receive))
        server_send = send
        try:
            send = self._send = self._bounded(send)
            await self._run(send)
            if self.headers_sent and not self.ended:
                if self.cut:
                    cut(scope, server_send)
                else:
                    # Inside the race: a client that never takes this last write is dropped
                    # by the write timeout like any other.
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.done = True
        except asyncio.CancelledError:
            if not (self._raced and self._absorbed()):
                raise
        finally:
            self._task = None  # no cancellation from here on
            watch.cancel()
            if self._guard is not None:
                self._guard.disarm()
            try:
                # The last client closes the upstream; what has to wait for that is shielded,
                # so that a cancellation from outside (it still propagates) cannot leak the
                # upstream or the lease.
                rest = run_now(self.gen.detach(self))
                if rest is not None:
                    await asyncio.shield(rest)
            finally:
                self._finish()
                # The write guard's callback and the bounded send refer back to this
                # subscriber: a cycle that only the garbage collector would free.
                self._guard = self._send = None

    async def _watch_disconnect(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a receive that fails: the client is gone too
            pass
        if not self.done:
            self._stop(Cause.CLIENT_GONE, Reach.RACE)

    def _bounded(self, send: Send) -> Send:
        """`send`, but a client that keeps one write blocked for write_timeout seconds is
        dropped like one that left. While a write is blocked this client reads nothing more
        from the buffer; this caps how long it holds the generation open."""
        timeout = self.ex.write_timeout
        if not timeout:
            return send
        self._guard = WriteGuard(timeout, lambda: self._stop(Cause.WRITE_TIMEOUT, Reach.RACE))
        return self._guard.bound(send)

    async def _run(self, send: Send) -> None:
        self._fencing = self.cause is None  # else fenced or aborted before the race began
        try:
            if self._fencing:
                await self._serve(send)
        except StreamfenceError as exc:
            # Often the generation's own error, raised again here: kept without its frames,
            # which refer back to the generation and to this subscriber.
            self.error = kept(exc)
        except asyncio.CancelledError:
            if self._raced or not self._absorbed():
                raise
        finally:
            self._fencing = False
        if self.cause is Cause.SUPERSEDED and not self.delivered:
            # The generation's upstream is closed first: that is the fence's promise, and a
            # client that does not read its frame must not hold the upstream open.
            await self.gen.finished.wait()
            self._note_fence_latency()
            await self._end_with_error(send, self._superseded_error())
        elif self.error is not None and not self.delivered:
            if self._inline:  # one writer at a time, even when aborted
                self._inline_over = asyncio.get_running_loop().create_future()
                await self._inline_over
                if self.delivered:  # that write delivered the answer (and maybe its end)
                    return
            await self._end_with_error(send, self.error)
            # Broken off upstream: after its error event the body ends as it would have
            # directly, unterminated (an answer already delivered ends cleanly, above).
            self.cut = self.headers_sent and self.error.cuts_body

    async def _serve(self, send: Send) -> None:
        gen = self.gen
        await gen.headers_ready.wait()
        if not gen.status:
            raise gen.headers_error()
        self.record.status = gen.status
        self.record.attempt = 0 if gen.lease is None else gen.lease.attempt
        if self.ex.went_upstream:
            self.record.forwarded_at = gen.forwarded_at
            self.record.upstream_headers_at = gen.headers_at
        if not gen.is_sse:
            await self._start(send, reframed=False)
            self._fencing = False  # past the fence once the headers are out (CONTRACT section 2)
            await self._copy(send)
            if gen.error is not None and not gen.completed:
                raise gen.error  # a body cut mid-way: cut for this client too
            return
        self.record.streaming = True
        await self._start(send, reframed=True)
        if not await self._copy(send):
            return
        if gen.error is not None:
            raise gen.error
        if not gen.completed:
            raise UpstreamError("streamfence: the upstream stream was closed before its end")

    async def _copy(self, send: Send) -> bool:
        """The buffer from this client's cursor, then live; False when the fence dropped it."""
        gen = self.gen
        while True:
            events = gen.buffer.since(self.cursor)
            if not events:
                if gen.done:
                    self.delivered = self.delivered or gen.completed
                    return True
                self.parked = True
                try:
                    await gen.wait(self)
                finally:
                    self.parked = False
                continue
            # With the whole answer in (completed), these are the stream's last events.
            if not await self._deliver(send, events, gen.completed):
                return False
            if self.ended:
                return True

    async def write_inline(self, events: list[bytes], last: bool = False) -> None:
        """The generation's reader writes the events this parked client is waiting for.
        Whatever goes wrong is left for this client's own task to see: it is still parked,
        and the generation wakes it at its end."""
        assert self._send is not None
        self._inline = True
        try:
            await self._deliver(self._send, events, last)
        finally:
            self._inline = False
            if self._inline_over is not None:
                self._inline_over.set_result(None)
                self._inline_over = None

    async def _deliver(self, send: Send, events: list[bytes], last: bool = False) -> bool:
        """The fence check, then the write; False when fenced (the events are dropped).

        Nothing awaits between the check and the write: a subscriber woken by the reader
        may run after the newer claim, and the reader writing inline may have been fenced
        in its own step. A non-SSE body is past the fence (CONTRACT section 2). This runs
        once per relayed event: it is kept to one call and one write."""
        gen, record = self.gen, self.record
        if gen.is_sse and gen.fenced_at is not None:
            record.dropped += len(events)
            return False
        body = events[0] if len(events) == 1 else b"".join(events)
        # The stream's last events, its body all in (`last`): the response ends with them, in
        # one write (the chunked terminator rides along) instead of one more a step later.
        # Not a large one: a client that stops reading must still meet the write timeout on
        # the end-of-body write, not leave a megabyte in the transport as a finished answer.
        end = last and len(body) <= END_WITH_LAST_MAX
        await send({"type": "http.response.body", "body": body, "more_body": not end})
        if end:
            self.delivered = self.done = self.ended = True
        self.cursor += len(events)
        record.bytes_out += len(body)
        if gen.is_sse:
            record.events += len(events)
            self.last_event = events[-1]
            if not self.delivered and dialects.ends_in(self.ex.dialect, events, body):
                self.delivered = True  # whatever the client does now, it has the answer
        if not gen.followable:
            gen.progress()
        return True

    async def _start(self, send: Send, *, reframed: bool) -> None:
        gen = self.gen
        await send(response_start(gen.status, gen.raw_headers, self._own_headers(), reframed))
        self.headers_sent = True
        self.record.first_byte_at = time.perf_counter()

    def _superseded_error(self) -> Superseded:
        lease = self.gen.lease
        assert lease is not None
        self.record.superseded_by = lease.newer_attempt
        return Superseded(lease.attempt, lease.newer_attempt)

    def _note_fence_latency(self) -> None:
        lease, closed = self.gen.lease, self.gen.closed_at
        if self.ex.source == Source.UPSTREAM and lease is not None and lease.superseded_at:
            if closed is not None:
                self.record.fence_latency = max(0.0, closed - lease.superseded_at)

    async def _end_with_error(self, send: Send, error: StreamfenceError) -> None:
        self.record.error = error.code
        if self.headers_sent:
            if self.gen.is_sse:  # a body of any other type has no place for a frame
                frame = dialects.stream_error_frame(self.ex.dialect, error, self.last_event)
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            return
        start, body = error_response_parts(error, self.ex.dialect, self._own_headers())
        self.record.status = error.status
        await send(start)
        self.record.first_byte_at = time.perf_counter()
        await send(body)

    def _own_headers(self) -> list[tuple[bytes, bytes]]:
        return self.ex.own_headers(None if self.gen.lease is None else self.gen.lease.attempt)

    def _finish(self) -> None:
        record = self.record
        if record.outcome is _PENDING:
            record.outcome, code = ending(self.cause, self.delivered, self.error)
            record.error = code or record.error
        record.finished_at = time.perf_counter()
        record.usage = self.gen.meter.usage  # what its generation's answer reported it cost
        # The error once per upstream failure: its generation's first client reports it.
        own = self.cause is None and self.ex.went_upstream
        self.on_finish(record, self.error if own else None)
