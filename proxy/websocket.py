"""WebSocket mode (CONTRACT section 8): an upgrade is routed like an HTTP request, opened
upstream with the `websockets` library, and its frames relayed both ways unchanged.

    client (uvicorn)  ->  size check, fence admit (/v1/responses)  ->  upstream socket
    upstream socket   ->  fence check (per response)               ->  client

The client is accepted only once the upstream has accepted, so that a refused upstream
handshake reaches the client with the upstream's own status, headers and body (ASGI's
"websocket.http.response" extension). A relay that cannot start at all answers 426 (404 /
401 / 400 for no route, no access token, a bad turn id) with a JSON body in the caller's
dialect, so that clients fall back to HTTP at once instead of retrying a bare 403.
Each side negotiates permessage-deflate and answers pings itself; close codes and reasons
pass through. websockets' errors are translated here, and only here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import anyio
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.frames import EXTERNAL_CLOSE_CODES

from proxy import dialects, turns
from proxy.errors import NoRoute, StreamfenceError, Unauthorized
from proxy.routing import RESERVED_PREFIX, Route, request_headers
from proxy.wsfence import FenceClose, ResponsesFence, TwinTable

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]
Headers = list[tuple[bytes, bytes]]
Data = str | bytes
Task = Callable[..., Coroutine[Any, Any, None]]

log = logging.getLogger("streamfence")

# The handshake of each hop is its own: websockets writes the upstream one.
HANDSHAKE_HEADERS = frozenset(
    {
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-accept",
        b"sec-websocket-protocol",
        b"user-agent",  # passed as websockets' user_agent_header instead (no duplicate)
    }
)
# Upstream handshake response headers that describe the upstream hop, not the client's.
_HOP_RESPONSE = frozenset(
    {"connection", "upgrade", "content-length", "date", "server", "transfer-encoding"}
)
CLOSE_GOING_AWAY, CLOSE_BAD_GATEWAY, CLOSE_TOO_BIG, CLOSE_INTERNAL = 1001, 1014, 1009, 1011


class UpgradeUnavailable(StreamfenceError):
    """The relay could not start: 426, so clients fall back to HTTP at once."""

    status = 426
    code = "websocket_unavailable"


@dataclass(slots=True)
class Upgrade:
    """One accepted upgrade request: where it goes and what crosses."""

    route: Route
    url: str  # ws:// or wss://
    client_headers: Headers  # as the client sent them: credential scope, turn header
    query: str
    headers: Headers  # the client's, as they go upstream
    user_agent: str | None
    subprotocols: list[str]
    dialect: str
    fenced: bool  # /v1/responses: each response.create is an attempt


def ws_url(http_url: str) -> str:
    if http_url.startswith("https://"):
        return "wss://" + http_url[len("https://") :]
    return "ws://" + http_url[len("http://") :]


def sendable(code: int | None) -> bool:
    """Whether `code` may appear in a close frame (1005/1006 are local-only)."""
    return code is not None and (code in EXTERNAL_CLOSE_CODES or 3000 <= code < 5000)


class WebSocketEndpoint:
    """Every WebSocket scope: the proxy's own prefix has none (404)."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime  # proxy.app.Runtime (not imported: app imports this module)
        self.twins = TwinTable()

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        rt = self.rt
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        path = raw_path.decode("latin-1")
        dialect = dialects.detect(path)
        name = "-"
        try:
            upgrade = self._plan(scope, path)
            name, dialect = upgrade.route.upstream.name, upgrade.dialect
            conn = await self.open(upgrade)
        except InvalidStatus as exc:
            rt.metrics.ws_connections.labels(name, "refused").inc()
            await _refuse_with_upstream(scope, send, exc)
            return
        except StreamfenceError as exc:
            outcome = "unreachable" if isinstance(exc, UpgradeUnavailable) else "rejected"
            rt.metrics.ws_connections.labels(name, outcome).inc()
            log.info("streamfence: websocket upgrade %s not relayed: %s", path, exc.message)
            await _refuse(scope, send, exc, dialect)
            return
        rt.metrics.ws_connections.labels(name, "accepted").inc()
        await send(
            {
                "type": "websocket.accept",
                "subprotocol": conn.subprotocol,
                "headers": _accept_headers(conn),
            }
        )
        session = Session(self, upgrade, conn, receive, send)
        rt.metrics.ws_open.inc()
        try:
            await session.run()
        finally:
            rt.metrics.ws_open.dec()

    def _plan(self, scope: Message, path: str) -> Upgrade:
        rt = self.rt
        if path == RESERVED_PREFIX or path.startswith(RESERVED_PREFIX + "/"):
            raise NoRoute("streamfence: no such endpoint under /_streamfence/")
        headers: Headers = scope["headers"]
        if not rt.authorized(headers):
            raise Unauthorized(
                "streamfence: this proxy needs its access token in the x-streamfence-token header"
            )
        query = scope.get("query_string", b"").decode("latin-1")
        route = rt.router.route(path, query)
        turns.explicit_turn_id(headers, rt.turn_header)  # validated now: 400 before accepting
        dialect = dialects.detect(route.path, route.upstream.dialect)
        out = request_headers(headers, rt.drop_headers | HANDSHAKE_HEADERS)
        user_agent = next((v.decode("latin-1") for n, v in headers if n == b"user-agent"), None)
        return Upgrade(
            route=route,
            url=ws_url(route.url),
            client_headers=headers,
            query=query,
            headers=out,
            user_agent=user_agent,
            subprotocols=list(scope.get("subprotocols") or []),
            dialect=dialect,
            fenced=dialect == dialects.OPENAI_RESPONSES and route.path.endswith("/responses"),
        )

    async def open(self, upgrade: Upgrade) -> ClientConnection:
        """The upstream socket; the one boundary where websockets' errors are translated
        (InvalidStatus passes: the caller relays the upstream's refusal as it is)."""
        up = upgrade.route.upstream
        try:
            return await connect(
                upgrade.url,
                additional_headers=[
                    (n.decode("latin-1"), v.decode("latin-1")) for n, v in upgrade.headers
                ],
                user_agent_header=upgrade.user_agent,
                subprotocols=upgrade.subprotocols or None,  # type: ignore[arg-type]
                open_timeout=up.connect_timeout,
                max_size=up.max_event_bytes,
                close_timeout=1.0,
            )
        except InvalidStatus:
            raise
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.warning("streamfence: upstream %s websocket unreachable: %s", up.name, cause)
            raise UpgradeUnavailable(
                f"streamfence: the upstream {up.name!r} could not be reached over WebSocket "
                "(use HTTP for this request)"
            ) from exc


class Session:
    """One relayed socket pair. The upstream socket may be replaced: the fence closes it to
    stop a superseded generation, and the next client message opens a new one."""

    def __init__(
        self,
        endpoint: WebSocketEndpoint,
        upgrade: Upgrade,
        conn: ClientConnection,
        receive: Receive,
        send: Send,
    ) -> None:
        self.endpoint = endpoint
        self.rt = endpoint.rt
        self.upgrade = upgrade
        self.conn: ClientConnection | None = conn
        self.receive = receive
        self._send = send
        up = upgrade.route.upstream
        frames = self.rt.metrics.ws_frames
        self._in = frames.labels(up.name, "client_to_upstream")
        self._out = frames.labels(up.name, "upstream_to_client")
        self.max_message = self.rt.config.server.websocket_max_message_bytes
        self.write_timeout: float = self.rt.config.server.write_timeout
        self.blocked_since: float | None = None  # while a client write is under way
        self.closing = False
        self._tg: anyio.abc.TaskGroup | None = None
        self._late: list[tuple[Task, tuple[Any, ...]]] = []
        self._open_lock = anyio.Lock()
        self.fence: ResponsesFence | None = None
        if upgrade.fenced:
            self.fence = ResponsesFence(self, endpoint.twins)

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._from_client)
                assert self.conn is not None
                tg.start_soon(self._from_upstream, self.conn)
                if self.write_timeout:
                    tg.start_soon(self._watch_writes)
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                if self.fence is not None:
                    self.fence.end_all()
                await self.retire_upstream(1000, "")
                while self._late:
                    fn, args = self._late.pop(0)
                    await fn(*args)

    def stop(self) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def spawn(self, fn: Task, *args: Any) -> None:
        """Run `fn` beside the relay (the fence's writes and releases); once the session is
        over, in its final cleanup instead."""
        if self._tg is not None:
            self._tg.start_soon(fn, *args)
        else:
            self._late.append((fn, args))

    def close_later(self, code: int, reason: str) -> None:
        self.spawn(self.close_client, code, reason)

    # -- client -> upstream --------------------------------------------------------------

    async def _from_client(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "websocket.disconnect":
                code: int = message.get("code") or 1000
                await self.retire_upstream(code, message.get("reason") or "")
                self.stop()
                return
            data: Data | None = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            size = len(data) if isinstance(data, bytes) else len(data.encode())
            if size > self.max_message:
                await self.close_client(
                    CLOSE_TOO_BIG, f"streamfence: message over {self.max_message} bytes"
                )
                return
            if self.fence is not None:
                try:
                    await self.fence.admit(data)
                except FenceClose as close:
                    await self.close_client(close.code, close.reason)
                    return
            await self.forward(data)

    async def forward(self, data: Data | None) -> None:
        """Send `data` upstream; None: only what the fence has to send again."""
        async with self._open_lock:  # one reopen at a time, and messages kept in order
            conn = self.conn
            again: list[Data] = []
            if conn is None:
                # The fence closed the previous upstream socket: a new one for this message.
                try:
                    conn = self.conn = await self.endpoint.open(self.upgrade)
                except (StreamfenceError, InvalidStatus):
                    if self.fence is not None:
                        self.fence.forward_failed()
                    await self.close_client(CLOSE_BAD_GATEWAY, "streamfence: upstream unavailable")
                    return
                self.spawn(self._from_upstream, conn)
                if self.fence is not None:
                    again, self.fence.resend = self.fence.resend, []
            with contextlib.suppress(ConnectionClosed):  # its reader reports the close
                for message in again if data is None else [*again, data]:
                    await conn.send(message)
                    self._in.inc()

    # -- upstream -> client --------------------------------------------------------------

    async def _from_upstream(self, conn: ClientConnection) -> None:
        fence = self.fence
        try:
            async for data in conn:
                if conn is not self.conn:
                    continue  # retired by the fence: whatever it still says is dropped
                if fence is not None and not fence.outgoing(data):
                    continue
                await self.send_client(data)
                self._out.inc()
                if fence is not None:
                    fence.delivered()
        except ConnectionClosed:
            pass
        if conn is not self.conn or self.closing:
            return  # closed on purpose
        self.conn = None
        rcvd = conn.protocol.close_rcvd
        if fence is not None:
            fence.upstream_lost()
        if rcvd is not None and sendable(rcvd.code):
            await self.close_client(rcvd.code, rcvd.reason)
        else:
            await self.close_client(CLOSE_BAD_GATEWAY, "streamfence: the upstream socket failed")

    async def send_client(self, data: Data) -> None:
        message = {"type": "websocket.send", "text": data} if isinstance(data, str) else None
        self.blocked_since = anyio.current_time()
        try:
            await self._send(message or {"type": "websocket.send", "bytes": data})
        finally:
            self.blocked_since = None

    async def _watch_writes(self) -> None:
        """Drops a client that keeps one write blocked for write_timeout (it does not read):
        its upstream is closed and its leases released. One check per quarter timeout, not a
        timer per message."""
        while True:
            await anyio.sleep(self.write_timeout / 4)
            since = self.blocked_since
            if since is not None and anyio.current_time() - since > self.write_timeout:
                log.info("streamfence: websocket client does not read; dropped")
                if self.fence is not None:
                    self.fence.client_write_timeout()
                self.closing = True
                self.stop()
                return

    # -- closing -------------------------------------------------------------------------

    async def close_client(self, code: int, reason: str) -> None:
        """Close the client with `code` (the upstream normally) and end the session."""
        if not self.closing:
            self.closing = True
            await self.retire_upstream(1000, "")
            with contextlib.suppress(Exception):  # the client may be gone already
                await self._send({"type": "websocket.close", "code": code, "reason": reason})
        self.stop()

    async def retire_upstream(self, code: int, reason: str) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await conn.close(code if sendable(code) else 1000, reason[:120])

    def retire_upstream_now(self) -> None:
        """Stop the upstream generation at once (the fence): the close handshake runs in the
        background; the next client message opens a new upstream socket."""
        conn, self.conn = self.conn, None
        if conn is not None and self._tg is not None:
            self._tg.start_soon(_close_quietly, conn)


async def _close_quietly(conn: ClientConnection) -> None:
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await conn.close(1000, "streamfence: response superseded")


def _accept_headers(conn: ClientConnection) -> Headers:
    response = conn.response
    if response is None:
        return []
    return [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in response.headers.raw_items()
        if name.lower() not in _HOP_RESPONSE and not name.lower().startswith("sec-websocket-")
    ]


def _can_respond(scope: Message) -> bool:
    return "websocket.http.response" in (scope.get("extensions") or {})


async def _refuse(scope: Message, send: Send, error: StreamfenceError, dialect: str) -> None:
    if not _can_respond(scope):
        await send({"type": "websocket.close", "code": 1008, "reason": error.code})
        return
    body = dialects.error_body(dialect, error)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send(
        {"type": "websocket.http.response.start", "status": error.status, "headers": headers}
    )
    await send({"type": "websocket.http.response.body", "body": body})


async def _refuse_with_upstream(scope: Message, send: Send, exc: InvalidStatus) -> None:
    response = exc.response
    if not _can_respond(scope):
        await send({"type": "websocket.close", "code": 1008, "reason": "upstream refused"})
        return
    body = bytes(response.body or b"")
    headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in response.headers.raw_items()
        if name.lower() not in _HOP_RESPONSE
    ]
    headers.append((b"content-length", b"%d" % len(body)))
    await send(
        {
            "type": "websocket.http.response.start",
            "status": response.status_code,
            "headers": headers,
        }
    )
    await send({"type": "websocket.http.response.body", "body": body})
