"""A small HTTP/1.1 transport for httpx, on the event loop, with httptools' parser.

Why not httpx's own (httpcore + h11): profiled in the benchmark (docs/performance.md), h11,
httpcore and anyio cost more than the rest of the proxy per relayed event, and added most of
its time to the first token. Here a connection is an asyncio.Protocol that httptools (C) parses
responses for (proxy/upstream/connection.py). httpx stays the client API; this is only its
transport, and the pool of idle connections.

What it promises, because the relay depends on it:
- closing a response that is not finished closes its connection at once, never drains;
- cancellation while waiting for headers (or anywhere) closes the connection;
- a finished keep-alive response returns its connection to a bounded, expiring idle pool;
- chunked, content-length and read-until-close bodies; TLS for https (default context);
- failures raise httpx's exceptions, so upstream.translate_errors maps them as before;
- a request on a reused connection that the server closed as it was reused, before it could
  have read the request (no response byte, the close within reuse.RESEND_WITHIN of the request's
  first byte), is sent once more on a fresh one; on a fresh one, or once the server has held
  the request longer, it is never sent again (`may_resend`);
- idle expiry follows the server's `Keep-Alive: timeout=N`, less a margin, capped;
- an egress proxy per upstream origin (proxy/config/egress.py, proxy/upstream/tunnel.py).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import httpx

from proxy.config.egress import EgressPlan
from proxy.upstream import reuse, tunnel
from proxy.upstream.connection import Connection, Key


def held_for(conn: Connection) -> float:
    """Seconds from the request's first byte to the connection's end (or to now)."""
    end = conn.lost_at if conn.lost_at is not None else time.monotonic()
    return max(0.0, end - conn.sent_at)


def may_resend(conn: Connection, request: httpx.Request) -> bool:
    """A request that failed on `conn` before its response may go once more on a fresh
    connection: `conn` was reused, no byte of the response came, the body can be sent
    again, and the server closed the connection before it could have taken the request."""
    if not conn.reused or conn.received or not isinstance(request.stream, httpx.ByteStream):
        return False
    return reuse.resends(held_for(conn))


def _not_resent(conn: Connection, exc: httpx.TransportError) -> httpx.TransportError:
    """`exc`, saying how long the server held the request when that is why it is final."""
    if conn.received or reuse.resends(held_for(conn)):
        return exc
    return type(exc)(
        f"{exc} {held_for(conn):.1f} s after it took the request (not sent again: the "
        "upstream may have processed it)"
    )


class Body(httpx.AsyncByteStream):
    """A response body. Closing it before its end closes the connection, at once."""

    def __init__(self, conn: Connection, read_timeout: float | None) -> None:
        self.conn = conn
        self.read_timeout = read_timeout
        self.done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.read():
            yield chunk

    async def read(self) -> bytes:
        """The next chunk of the body, b"" at its end."""
        conn = self.conn
        while (chunk := conn.take()) is None:
            conn.waiter = conn.loop.create_future()
            try:
                await conn.wait(conn.waiter, self.read_timeout)
            except BaseException:
                conn.close()
                raise
            finally:
                conn.waiter = None
        return chunk

    def at_end(self) -> bool:
        """The whole body is in and has been read: the next read returns b"" at once."""
        conn = self.conn
        return conn.complete and not conn.buffer and conn.error is None

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.conn.pool.release(self.conn)


class Transport(httpx.AsyncBaseTransport):
    """httpx's transport interface over `Connection`s, with an idle pool per upstream host."""

    def __init__(
        self,
        *,
        max_idle_per_host: int = 64,
        # Under the 5 s idle timeout of uvicorn and Node servers, so a pooled connection
        # is not reused just as the server closes it (that request would fail with a 502).
        keepalive_expiry: float = 4.0,
        ssl_context: ssl.SSLContext | None = None,
        egress: EgressPlan | None = None,
    ) -> None:
        self.max_idle = max_idle_per_host
        self.expiry = keepalive_expiry
        self._ssl = ssl_context
        self.egress = egress or EgressPlan()
        self._idle: dict[Key, deque[Connection]] = {}
        self._all: set[Connection] = set()

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
            self._ssl.set_alpn_protocols(["http/1.1"])
        return self._ssl

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}")
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        conn = self._acquire(key)
        if conn is not None:
            try:
                await self._exchange(conn, request, timeouts)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                # The server closed the pooled connection as it was reused: the stale
                # keep-alive race, and the request goes once more on a fresh connection.
                # Anything else, and a close after the server held the request, is final.
                if not may_resend(conn, request):
                    final = _not_resent(conn, exc)
                    if final is exc:
                        raise
                    raise final from exc
                conn = None
        if conn is None:
            conn = await self._connect(key, timeouts.get("connect"))
            await self._exchange(conn, request, timeouts)
        if conn.proxy is not None and conn.status == 407:
            conn.close()
            raise tunnel.refused_credentials(conn.proxy)
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=Body(conn, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _exchange(
        self, conn: Connection, request: httpx.Request, timeouts: dict[str, Any]
    ) -> None:
        """Sends the request and waits for the response head."""
        try:
            await conn.send(request, timeouts)
            assert conn.started is not None
            await conn.wait(conn.started, timeouts.get("read"))
        except BaseException:
            conn.close()  # cancelled or failed before the headers: nothing to reuse
            raise

    async def _connect(self, key: Key, seconds: float | None) -> Connection:
        scheme, host, port = key
        tls = self._ssl_context() if scheme == "https" else None
        proxy = self.egress.proxy_for(scheme, host, port)
        if proxy is not None:
            conn = await tunnel.open_connection(
                proxy, host, port, tls, lambda: Connection(self, key), seconds
            )
            conn.proxy = None if tls else proxy
            self._all.add(conn)
            return conn
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(seconds):
                _, protocol = await loop.create_connection(
                    lambda: Connection(self, key),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls else None,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except (OSError, ssl.SSLError, ssl.CertificateError) as exc:
            raise httpx.ConnectError(f"could not connect to {host}:{port}: {exc}") from exc
        self._all.add(protocol)
        return protocol

    def _acquire(self, key: Key) -> Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have expired
            if not conn.closed and now - conn.idle_since < conn.expiry:
                conn.reused = True
                return conn
            conn.close()
        return None

    def release(self, conn: Connection) -> None:
        reusable = conn.complete and conn.keep_alive and not conn.closed and conn.error is None
        if not reusable:
            conn.close()
            return
        conn.started = None  # idle: unexpected data now closes it
        conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(conn.key, deque())
        while idle and (
            len(idle) >= self.max_idle or conn.idle_since - idle[0].idle_since > idle[0].expiry
        ):
            idle.popleft().close()
        idle.append(conn)

    def forget(self, conn: Connection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def in_use(self) -> int:
        """Open connections that carry a response not yet closed (for leak checks)."""
        return sum(1 for c in self._all if c.started is not None and not c.closed)

    def idle(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    async def aclose(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
