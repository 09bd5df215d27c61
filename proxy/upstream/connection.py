"""One upstream HTTP/1.1 connection for proxy/upstream/transport.py: an asyncio.Protocol that
httptools (C) parses responses for.

The body of one socket read is handed to the reader (`transport.Body`) as one chunk, and a
read costs one future at most. A body that comes in many small reads back to back is read in
batches (proxy/upstream/pacing.py). A connection is closed at once, never drained, when its body is
closed before its end; a finished keep-alive one goes back to its pool (`Pool.release`).
"""

from __future__ import annotations

import _socket
import asyncio
import socket
import time
from typing import Any, Protocol, cast

import httptools
import httpx

from proxy.config.egress import ProxyURL
from proxy.upstream.pacing import PAUSE, ReadPacer
from proxy.upstream.reuse import keep_alive_expiry

HIGH_WATER = 256 * 1024  # buffered, unread body bytes before reading from the socket pauses
Key = tuple[str, str, int]


class Pool(Protocol):
    """What a connection needs of its transport."""

    expiry: float  # seconds an idle connection is kept unless its server says otherwise

    def forget(self, conn: Connection) -> None: ...

    def release(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One upstream connection, one request at a time."""

    def __init__(self, pool: Pool, key: Key) -> None:
        self.pool = pool
        self.key = key
        # Created on the loop it serves. Kept: asyncio.get_running_loop() costs a getpid()
        # system call on Python 3.11, and a relayed event took two.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.lost_at: float | None = None  # when the connection ended (time.monotonic)
        self.expiry = pool.expiry
        self.proxy: ProxyURL | None = None  # set: requests go in absolute form to it
        self._write_ready: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._watched: asyncio.Future[None] | None = None
        self._pausing: asyncio.TimerHandle | None = None
        self._reset(head=False)

    def _reset(self, head: bool) -> None:
        self.head = head
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.framed = False  # content-length or chunked: EOF before the end is an error
        self.interim = False
        self.started: asyncio.Future[None] | None = None
        self.buffer: list[bytes] = []
        self.buffered = 0
        self.pieces: list[bytes] = []
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.reading_paused = False
        self.received = False  # any byte of this response: it may not be sent again
        self.sent_at = 0.0  # when the request's first byte was written (time.monotonic)
        self.pacer = ReadPacer()

    # -- asyncio.Protocol ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.started is None:  # idle: a server may not speak unasked
            self.close()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("upstream switched protocols"))
            return
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP response: {exc}"))
            return
        if self.pieces:
            pieces = self.pieces
            self.buffer.append(pieces[0] if len(pieces) == 1 else b"".join(pieces))
            self.pieces = []
            self.buffered += len(self.buffer[-1])
            if self.buffered > HIGH_WATER and not self.reading_paused and self.transport:
                self.reading_paused = True
                self.transport.pause_reading()
            self._wake()
        if not self.complete and self.pacer.pause_after(len(data), time.monotonic()):
            self._pause_briefly()

    def _pause_briefly(self) -> None:
        """Out of the poll for PAUSE, so the writes back to back gather (proxy/upstream/pacing.py).
        No read comes during a pause: one is never started twice."""
        assert self.transport is not None
        if not self.reading_paused:
            self.transport.pause_reading()
        self._pausing = self.loop.call_later(PAUSE, self._paused)

    def _paused(self) -> None:
        self._pausing = None
        self.pacer.resumed(time.monotonic())
        if not self.reading_paused and not self.closed and self.transport is not None:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.lost_at = time.monotonic()
        # Nothing more can arrive; the parser holds this protocol's callbacks, a cycle that
        # only the garbage collector would free (one per closed connection, one per fence).
        del self.parser
        # close() will not run now (closed is set): a timer left armed would hold this
        # connection, its stored error and that error's frames (a whole request) until the
        # idle timeout, minutes later. Found by the soak test.
        self._stop_timers()
        self.pool.forget(self)
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_exception(httpx.WriteError("upstream closed the connection"))
        if self.started is None or self.complete or self.error is not None:
            return
        if not self.started.done():
            error: Exception = httpx.RemoteProtocolError(
                "upstream closed the connection without sending a response"
            )
            if exc is not None:
                error = httpx.ReadError(f"upstream connection failed: {exc!r}")
            self._fail(error)
        elif not self.framed and exc is None:
            self.complete = True  # a body delimited by the end of the connection
            self._wake()
        else:
            what = f": {exc!r}" if exc is not None else ""
            self._fail(httpx.RemoteProtocolError(f"upstream body ended early{what}"))

    def pause_writing(self) -> None:
        self._write_ready = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)
        self._write_ready = None

    # -- httptools callbacks ---------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # 100 Continue and friends: the real response follows
            self.interim = True
            self.headers = []
            return
        self.status = status
        for name, value in self.headers:
            lname = name.lower()
            if lname == b"content-length" or (
                lname == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                self.framed = True
            elif lname == b"keep-alive":
                self.expiry = keep_alive_expiry(value, self.expiry)
        if self.head:
            # httptools cannot be told a HEAD response has no body: end it here and
            # never reuse the connection.
            self.complete = True
        assert self.started is not None
        if not self.started.done():
            self.started.set_result(None)

    def on_body(self, body: bytes) -> None:
        if not self.head:
            self.pieces.append(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self.keep_alive = not self.head and self.parser.should_keep_alive()
        self._wake()

    # -- for the transport and the body stream --------------------------------------
    def _fail(self, error: Exception) -> None:
        self.error = error
        if self.started is not None and not self.started.done():
            self.started.set_exception(error)
            self.started.exception()  # retrieved: the caller may be gone already
        self._wake()
        self.close()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def send(self, request: httpx.Request, timeouts: dict[str, Any]) -> None:
        assert self.transport is not None
        self._reset(head=request.method == "HEAD")
        self.started = self.loop.create_future()
        target = request.url.raw_path
        if self.proxy is not None:  # absolute form, for the proxy to forward
            url = request.url
            target = b"%s://%s%s" % (url.raw_scheme, url.netloc, target)
        head = [b"%s %s HTTP/1.1" % (request.method.encode(), target)]
        chunked = False
        for name, value in request.headers.raw:
            head.append(b"%s: %s" % (name, value))
            if name.lower() == b"transfer-encoding":
                chunked = value.strip().lower() == b"chunked"
        if self.proxy is not None and self.proxy.authorization is not None:
            head.append(b"Proxy-Authorization: " + self.proxy.authorization)
        data = b"\r\n".join(head) + b"\r\n\r\n"
        self.sent_at = time.monotonic()
        async for part in cast(httpx.AsyncByteStream, request.stream):
            if chunked and part:
                part = b"%x\r\n%s\r\n" % (len(part), part)
            data += part
            if len(data) > HIGH_WATER:
                await self._write(data, timeouts.get("write"))
                data = b""
        if chunked:
            data += b"0\r\n\r\n"
        await self._write(data, timeouts.get("write"))

    async def _write(self, data: bytes, seconds: float | None) -> None:
        if self.closed or self.transport is None:
            raise httpx.WriteError("upstream closed the connection")
        self.transport.write(data)
        if self._write_ready is not None:
            try:
                async with asyncio.timeout(seconds):
                    await asyncio.shield(self._write_ready)
            except TimeoutError:
                raise httpx.WriteTimeout("upstream did not accept the request in time") from None

    async def wait(self, future: asyncio.Future[None], seconds: float | None) -> None:
        if future.done():
            return future.result()
        if seconds is not None:
            # One lazily re-armed timer per connection, not one per wait: a relayed event
            # is one wait, and a timer set and cancelled per event was a visible share of it.
            loop = self.loop
            self._deadline = loop.time() + seconds
            if self._timer is None or self._timer.when() > self._deadline:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = loop.call_at(self._deadline, self._check_deadline)
        self._watched = future
        try:
            await future
        finally:
            self._watched = None

    def _check_deadline(self) -> None:
        self._timer = None
        future = self._watched
        if future is None or future.done() or self.closed:
            return  # nobody is waiting: the next wait arms a new timer
        loop = self.loop
        if loop.time() >= self._deadline:
            future.set_exception(httpx.ReadTimeout("upstream sent nothing in time"))
        else:
            self._timer = loop.call_at(self._deadline, self._check_deadline)

    def take(self) -> bytes | None:
        """The buffered body, or None when the caller must wait."""
        if self.buffer:
            buffer = self.buffer
            chunk = buffer[0] if len(buffer) == 1 else b"".join(buffer)
            self.buffer = []
            self.buffered = 0
            if self.reading_paused and self.transport is not None:
                self.reading_paused = False
                if self._pausing is None:
                    self.transport.resume_reading()
            return chunk
        if self.error is not None:
            raise self.error
        if self.complete:
            return b""
        return None

    def _stop_timers(self) -> None:
        for timer in (self._timer, self._pausing):
            if timer is not None:
                timer.cancel()
        self._timer = self._pausing = None

    def abort(self) -> None:
        """Close now, the FIN included. uvloop closes a socket only when the loop next
        runs its callbacks, after every other I/O of the iteration, and a fence is over when
        the upstream sees its connection end (bench B5): shut it down in this step."""
        if not self.closed and self.transport is not None:
            # Even with a request body still to write: that write fails, not the close.
            _shut_down(self.transport.get_extra_info("socket"))
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._stop_timers()
            if self.transport is not None:
                self.transport.close()
            self.pool.forget(self)


def _shut_down(sock: socket.socket | None) -> None:
    if sock is None:
        return
    # uvloop's transport socket refuses shutdown(): the C socket type around the same
    # descriptor (family and type do not matter to shutdown, and socket.socket's would
    # cost an enum conversion each), detached again: the transport owns and closes it.
    own = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM, 0, sock.fileno())
    try:
        own.shutdown(_socket.SHUT_RDWR)
    except OSError:
        pass  # already reset by the peer: closed all the same
    finally:
        own.detach()
