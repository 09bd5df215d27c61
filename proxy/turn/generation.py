"""A generation: one upstream response of a turn, and every client reading it.

Its reader task claims the turn's fencing token (which supersedes any older generation of the
turn), sends the request, and appends the answer to a bounded buffer: SSE events (stamped with
an `id:` where resuming needs one) or any other body's raw chunks. Its clients
(`proxy.turn.relay.Subscriber`: the first one, and any follower) read the buffer from their own
cursors. When a newer generation claims the turn, the lease callback closes the upstream (not
drained) and tells every client, which then writes the superseded frame. The last client
leaving closes the upstream too; the lease is held until then, so that events still in the
buffer stay under the fence. A generation published for other processes has a tee
(`proxy.turn.tee`): the log's writer, which keeps the upstream open while others read it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

from proxy.errors import StreamfenceError, UpstreamError
from proxy.registry import Lease, Registry
from proxy.registry.genlog.meta import End
from proxy.tasks import spawn
from proxy.turn.ask import Ask
from proxy.turn.buffer import Budget, EventBuffer
from proxy.turn.clients import Clients, Watcher
from proxy.turn.meter import Meter
from proxy.turn.tee import Tee, TeeFor, hold
from proxy.upstream import client as upstream
from proxy.upstream.client import UpstreamClient
from proxy.wire import dialects, health
from proxy.wire.sse import event_id, resumes_after, with_id

log = logging.getLogger("streamfence")

# How a published generation's log ends, bound once: see proxy/turn/rule.py NEW.
_COMPLETED, _FAILED, _SUPERSEDED = End.COMPLETED, End.FAILED, End.SUPERSEDED


class Generation:
    asked_upstream = True  # (a generation of another process, followed here, did not)

    def __init__(
        self,
        ask: Ask,
        client: UpstreamClient,
        registry: Registry | None,
        budget: Budget,
        on_end: Callable[[Generation], None] = lambda g: None,
        lease: Lease | None = None,
        tee: TeeFor | None = None,
    ) -> None:
        self.ask = ask
        self._claimed = lease  # the turn was claimed before (claim_or_follow)
        if lease is None and ask.key is not None and registry is not None:
            # Claimed (and the older generation fenced) in the request's own step where the
            # backend allows it: the reader starts a loop iteration later, long under load.
            self._claimed = registry.claim_now(ask.key)
        # Published for followers in other processes (`proxy.turn.remote`), if given: what
        # makes its tee (`proxy.turn.tee`), once it holds its turn.
        self._tee_for = tee
        self.tee: Tee | None = None
        self._client, self._registry, self._on_end = client, registry, on_end
        self.followable = ask.followable
        self.lease: Lease | None = None
        self.response: httpx.Response | None = None
        self.status = 0  # the upstream's status and headers, kept for followers
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.is_sse = False
        self.fenced_at: float | None = None  # when a newer generation's claim fenced this one
        self.closing = False  # its upstream is being closed for want of clients: not followable
        self.error: StreamfenceError | None = None
        self.buffer = EventBuffer(ask.buffer_bytes, budget)
        self.meter = Meter(ask.dialect, self.buffer)  # what the answer reports it cost
        self.done = False  # the reader has finished, for any reason
        self.completed = False  # ... and the upstream's whole answer is in the buffer
        self.retained = ask.retain_for > 0  # kept after its clients leave, for replays
        # The later of the request, its response headers and its last content event: what
        # its health is judged by (proxy.wire.health). Keep-alives do not move it.
        self.alive_at = time.monotonic()
        self._keepalives, self._keepalive_firsts, self._drops_keepalives = dialects.keepalives(
            ask.dialect
        )
        self.forwarded_at: float | None = None  # perf_counter readings, for the records
        self.headers_at: float | None = None
        self.closed_at: float | None = None
        self.headers_ready = asyncio.Event()
        self.finished = asyncio.Event()  # the reader is done and the upstream closed
        self._room = asyncio.Event()
        self._ended = False
        self._reader_stopped = False
        self._expiry: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        self.clients = Clients(loop)  # its subscribers, and those waiting for its next event
        self._task: asyncio.Task[None] | None = loop.create_task(self._read())

    # -- state --------------------------------------------------------------------------
    @property
    def fenced(self) -> bool:
        return self.fenced_at is not None

    @property
    def last_id(self) -> int:
        return self.buffer.last_id

    @property
    def token(self) -> int | None:
        return None if self.lease is None else self.lease.token

    def last_alive(self) -> float:
        """When the upstream last sent content (its headers, the request): time.monotonic."""
        return self.alive_at

    def healthy(self, within: float, now: float) -> bool:
        """`last_alive` less than `within` seconds before `now`: CONTRACT section 3."""
        return health.healthy(self.last_alive(), now, within)

    def event_id(self, n: int) -> bytes:
        return event_id(self.token or 0, n)

    def cursor_after(self, last_event_id: bytes | None) -> int | None:
        """Where a `Last-Event-ID` resumes in this generation, None if it is not one of its."""
        if not self.ask.stamp_ids or self.token is None:
            return None
        number = resumes_after(last_event_id, self.token)
        return number if number is not None and self.buffer.holds(number) else None

    # -- the reader ---------------------------------------------------------------------
    async def _read(self) -> None:
        ask = self.ask
        try:
            if ask.key is not None and self._registry is not None:
                self.lease = self._claimed or await self._registry.claim(ask.key)
                self.lease.on_superseded(self._superseded)
                if self.fenced:
                    return
                if self._tee_for is not None and self.lease.token > 0:  # < 0: unfenced
                    self.tee = self._tee_for(self.lease.token)
            self.forwarded_at = time.perf_counter()
            self.response = await self._client.send(ask.request, ask.upstream)
            self.headers_at = time.perf_counter()
            self.alive_at = time.monotonic()
            self.status = self.response.status_code
            self.raw_headers = self.response.headers.raw
            self.is_sse = upstream.is_event_stream(self.response)
            if self.tee is not None:
                pairs = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in self.raw_headers]
                self.tee.started(self.status, pairs)
            self.headers_ready.set()
            if self.is_sse:
                self.completed = await upstream.read_events(
                    self.response, ask.upstream, ask.max_event_bytes, self._take
                )
            else:  # the body's own failures are ours already (upstream.UpstreamClient)
                async for chunk in self.response.aiter_raw():
                    await self._take([chunk], stamp=False)
                self.completed = True
        except StreamfenceError as exc:
            self.error = exc
        finally:
            await self._close_response()
            self._read_over()
            if self.tee is not None:
                done = _COMPLETED if self.completed else _FAILED
                spawn(self.tee.end(_SUPERSEDED if self.fenced else done))
            if self.retained and self.completed and not self.fenced:
                loop = asyncio.get_running_loop()
                self._expiry = loop.call_later(self.ask.retain_for, self._unretain)
            else:
                self._unretain()

    def _read_over(self) -> None:
        """The reader's end, for any reason: every waiting subscriber may now finish."""
        self.meter.close(self.is_sse, self.raw_headers)  # first: each client reports it
        self.done = True
        self.headers_ready.set()
        self.clients.wake()
        self.finished.set()
        # Not kept: a cancelled reader's exception holds its frames, and so this generation.
        self._task = None

    async def _close_response(self) -> None:
        response, self.response = self.response, None
        if response is not None:
            # Closes the connection: nothing drained. Not shielded (asyncio.shield would run it
            # as a task of its own, a loop iteration later, long under load): the reader is
            # cancelled once only (_stop_reader), so nothing interrupts this.
            await response.aclose()
        if self.closed_at is None:
            self.closed_at = time.perf_counter()

    async def _take(self, events: list[bytes], last: bool = False, *, stamp: bool = True) -> bool:
        # A body's every chunk is content; of an event stream, what is not a keep-alive: the
        # first event's first byte tells most reads (a call per read was a visible cost).
        content = (
            not self.is_sse
            or events[0][0] not in self._keepalive_firsts
            or dialects.carries_content(events, self._keepalives)
        )
        if content:
            self.alive_at = time.monotonic()
        if self._drops_keepalives and self.is_sse:
            events = dialects.without_keepalives(events, self._keepalives)
            if not events:
                return True  # nothing for this dialect's clients (dialects.drops_keepalives)
        buffer = self.buffer
        before = buffer.last_id
        if stamp and self.ask.stamp_ids:
            events = [with_id(e, self.event_id(before + 1 + i)) for i, e in enumerate(events)]
        buffer.add(events)
        if self.tee is not None:
            self.tee.append(events, content)
        clients = self.clients
        watchers = clients.all
        sole = next(iter(watchers)) if len(watchers) == 1 else None
        if sole is not None and sole.parked and sole.cursor == before:
            # The one client, caught up and waiting: write for it here, as a plain relay
            # would, instead of waking its task for every event (most generations have one
            # client, and the task switch cost a fifth of the proxy's CPU per event).
            await sole.write_inline(events, last)
        elif clients.waiting:
            clients.wake()
        if self.followable and buffer.over_cap():
            self._overflow()
        while not self.followable and buffer.size > buffer.cap and watchers:
            # Back-pressure: nobody may follow any more, so the buffer keeps only what its
            # clients have yet to write, and the slowest client's pace throttles the upstream.
            self._room.clear()
            await self._room.wait()
        return True

    def _overflow(self) -> None:
        self.followable = False
        self.buffer.budget.overflows += 1
        log.warning(
            "streamfence: turn %s: its buffer is over its cap; identical requests will start "
            "a new generation instead of following it",
            (self.ask.key or "-")[:16],
        )
        self._trim()

    def _trim(self) -> None:
        self.meter.dropping()  # it keeps what the dropped events say of the usage
        self.buffer.drop_through(self.clients.slowest(self.last_id))
        self._room.set()

    def _superseded(self) -> None:
        # Runs in the newer claimer's task: close the upstream at once (the reader's
        # `finally`), then every client writes its frame. A non-SSE answer whose headers are
        # in is not fenced: the upstream has done its work (CONTRACT section 2).
        if self.status and not self.is_sse:
            return
        assert self.lease is not None
        self.fenced_at = self.lease.superseded_at
        if self.response is not None and upstream.abort(self.response):
            # Closed in this step: cancelling the reader closes it only when the reader
            # next runs, a loop iteration or more later (milliseconds under load).
            self.closed_at = time.perf_counter()
        self._stop_reader()
        for watcher in list(self.clients.all):
            watcher.superseded()
        if self._expiry is not None:
            self._expiry.cancel()
        self._unretain()

    def _stop_reader(self) -> None:
        """Cancel the reader, once: a second cancellation could interrupt its closing."""
        if not self._reader_stopped and self._task is not None:
            self._reader_stopped = True
            self._task.cancel()

    def _unretain(self) -> None:
        self.retained = False
        if not self.clients.all:
            self._release_later()

    # -- the subscribers ----------------------------------------------------------------
    def attach(self, watcher: Watcher) -> None:
        self.clients.all[watcher] = None
        if self.fenced:
            watcher.superseded()

    async def wait(self, watcher: Watcher) -> None:
        """Until there is an event after the watcher's cursor, or the reader is done."""
        while watcher.cursor >= self.buffer.last_id and not self.done:
            await self.clients.next()

    def progress(self) -> None:
        """A subscriber wrote, to a buffer nobody may follow: it keeps only what is unwritten."""
        self._trim()

    async def detach(self, watcher: Watcher) -> None:
        """`watcher` is gone. The last one closes the upstream and, once the reader is done,
        releases the lease and the buffer (unless the table retains it for replays)."""
        watchers = self.clients.all
        if watcher not in watchers:
            return
        del watchers[watcher]
        self._room.set()
        if watchers:
            if not self.followable:
                self._trim()
            return
        tee = self.tee
        if not self.done and tee is not None and not tee.broken:
            # Other processes may read it through its tee: their readers decide, in the
            # background (no await here, where a local twin could attach meanwhile).
            spawn(hold(self, tee))
            return
        await self.close_for_want_of_clients()

    def watched(self) -> bool:
        """Some client in this process reads this generation."""
        return bool(self.clients.all)

    async def close_for_want_of_clients(self) -> None:
        """No client is left: close the upstream if it is still open, then release."""
        if not self.done:
            self.closing = True
            self._stop_reader()
        if not self.finished.is_set():
            await self.finished.wait()  # the last subscriber calls this shielded
        if not self.retained:
            await self.end()

    async def end(self) -> None:
        """Release the lease and the buffer; once."""
        if self._ended:
            return
        self._ended = True
        self._on_end(self)  # first: the table reads the final event id
        self.buffer.clear()
        if self.lease is not None and self._registry is not None:
            await self._registry.release(self.lease)
        if self.lease is not None:
            self.lease.forget()  # its callback refers back to this generation

    def _release_later(self) -> None:
        if self.done and not self._ended:
            spawn(self.end())

    def headers_error(self) -> StreamfenceError:
        """Why there is no response to send (called once headers_ready is set)."""
        return self.error or UpstreamError("streamfence: the upstream request ended early")
