"""WebSocket mode (CONTRACT section 8): the relay of one accepted upgrade, frames both ways
unchanged (proxy/websocket/endpoint.py accepts it; proxy/websocket/upgrade.py routes and opens
it).

    client (uvicorn)  ->  size check, fence admit (/v1/responses)  ->  upstream socket
    upstream socket   ->  fence check (per response)               ->  client

Each side negotiates permessage-deflate and answers pings itself; close codes and reasons
pass through (1005/1006, which never appear in a close frame, become 1000 / 1014). A client
that keeps one write blocked for `write_timeout` is dropped; a client message over
`websocket_max_message_bytes` closes 1009.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import anyio
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.frames import EXTERNAL_CLOSE_CODES

from proxy.asgi import Receive, Send
from proxy.errors import StreamfenceError
from proxy.runtime import Runtime
from proxy.websocket.attempts import TwinTable
from proxy.websocket.fence import FenceClose, ResponsesFence
from proxy.websocket.types import Data, Task
from proxy.websocket.upgrade import Upgrade, open_upstream

log = logging.getLogger("streamfence")

CLOSE_BAD_GATEWAY, CLOSE_TOO_BIG = 1014, 1009


def sendable(code: int | None) -> bool:
    """Whether `code` may appear in a close frame (1005/1006 are local-only)."""
    return code is not None and (code in EXTERNAL_CLOSE_CODES or 3000 <= code < 5000)


class Session:
    """One relayed socket pair. The upstream socket may be replaced: the fence closes it to
    stop a superseded generation, and the next client message opens a new one."""

    def __init__(
        self,
        rt: Runtime,
        twins: TwinTable,
        upgrade: Upgrade,
        conn: ClientConnection,
        receive: Receive,
        send: Send,
    ) -> None:
        self.rt = rt
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
            self.fence = ResponsesFence(self, twins)

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
            self.fence = None  # it refers back to this session: a cycle for the collector

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
                    conn = self.conn = await open_upstream(self.upgrade)
                except (StreamfenceError, InvalidStatus):
                    if self.fence is not None:
                        self.fence.forward_failed()
                    await self.close_client(CLOSE_BAD_GATEWAY, "streamfence: upstream unavailable")
                    return
                self.spawn(self._from_upstream, conn)
                if self.fence is not None:
                    again, self.fence.resend = self.fence.resend, []
            if data is not None:
                # The fence may have listed this very message to send again while this call
                # waited for the lock: it goes once.
                again = [m for m in again if m is not data]
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
        except OSError:  # uvicorn's ClientDisconnected: the client went away mid-write
            self.closing = True
            self.stop()  # the session's cleanup ends its responses as the client's leaving
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
