"""WebSocket mode (CONTRACT section 8): every WebSocket scope, its upgrade planned, refused or
accepted (proxy/websocket/upgrade.py routes it and opens the upstream socket; an accepted one
is relayed by proxy/websocket/session.py).

The client is accepted only once the upstream has accepted, so that a refused upstream
handshake reaches the client as it came.
"""

from __future__ import annotations

import logging
import os
import ssl

from websockets.exceptions import InvalidStatus

from proxy.asgi import Message, Receive, Send
from proxy.errors import StreamfenceError, UpgradeUnavailable
from proxy.runtime import Runtime
from proxy.upstream.client import ssl_context_for
from proxy.websocket.attempts import TwinTable
from proxy.websocket.session import Session
from proxy.websocket.upgrade import (
    accept_headers,
    open_upstream,
    plan,
    refuse,
    refuse_with_upstream,
)
from proxy.wire import dialects

log = logging.getLogger("streamfence")


class WebSocketEndpoint:
    """Every WebSocket scope: the proxy's own prefix has none (404)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.twins = TwinTable()
        self._context: ssl.SSLContext | None = None
        self._context_read = False

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self._context_read:  # once: loading a CA bundle takes milliseconds
            self._context = ssl_context_for(self.rt.config.server.ca_bundle, os.environ)
            self._context_read = True
        return self._context

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        rt = self.rt
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        path = raw_path.decode("latin-1")
        dialect = dialects.detect(path)
        name = "-"
        try:
            upgrade = plan(rt, scope, path, self.ssl_context())
            name, dialect = upgrade.route.upstream.name, upgrade.dialect
            conn = await open_upstream(upgrade)
        except InvalidStatus as exc:
            rt.metrics.ws_connections.labels(name, "refused").inc()
            await refuse_with_upstream(scope, send, exc)
            return
        except StreamfenceError as exc:
            outcome = "unreachable" if isinstance(exc, UpgradeUnavailable) else "rejected"
            rt.metrics.ws_connections.labels(name, outcome).inc()
            log.info("streamfence: websocket upgrade %s not relayed: %s", path, exc.message)
            await refuse(scope, send, exc, dialect)
            return
        accept = {
            "type": "websocket.accept",
            "subprotocol": conn.subprotocol,
            "headers": accept_headers(conn),
        }
        try:
            await send(accept)
        except OSError:  # the client left while the upstream was being opened
            rt.metrics.ws_connections.labels(name, "client_gone").inc()
            await conn.close()
            return
        rt.metrics.ws_connections.labels(name, "accepted").inc()
        session = Session(rt, self.twins, upgrade, conn, receive, send)
        rt.metrics.ws_open.inc()
        try:
            await session.run()
        finally:
            rt.metrics.ws_open.dec()
