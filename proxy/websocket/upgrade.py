"""Where a WebSocket upgrade goes, and the answers to upgrades that are not relayed.

An upgrade is routed like an HTTP request (prefix, upstream, access token, turn header
validated) and opened upstream with `websockets`: `wss://` for an `https://` upstream,
through the egress proxy that proxy/config/egress.py chooses for HTTP too (`egress_proxy`, else
HTTPS_PROXY / HTTP_PROXY / NO_PROXY), with the configured CA bundle; permessage-deflate
offered. websockets' errors are translated here, and only here. A refused upstream
handshake is passed to the client as it came (status, headers, body) with ASGI's
"websocket.http.response" extension; an upgrade that cannot be relayed at all gets 426
(404 / 401 / 400 for no route, no access token, a bad turn id) with a JSON body in the
caller's dialect, so that clients fall back to HTTP at once.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI

from proxy.asgi import Headers, Message, Send
from proxy.config import egress
from proxy.errors import NoRoute, StreamfenceError, Unauthorized, UpgradeUnavailable
from proxy.upstream.routing import RESERVED_PREFIX, Route, request_headers
from proxy.wire import dialects, turns

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
    proxy: str | None = None  # the egress proxy's URL (with its credentials), None: direct
    ssl: ssl.SSLContext | None = None  # wss:// only; None: websockets' default context


def ws_url(http_url: str) -> str:
    if http_url.startswith("https://"):
        return "wss://" + http_url[len("https://") :]
    return "ws://" + http_url[len("http://") :]


def plan(rt: Any, scope: Message, path: str, context: ssl.SSLContext | None) -> Upgrade:
    """Route an upgrade like an HTTP request; raises what the client is answered with.
    `context`: the CA bundle's ([server] ca_bundle, SSL_CERT_FILE / SSL_CERT_DIR)."""
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
    # Validated at startup (config.check): a bad setting cannot get this far.
    choice = egress.choose(route.upstream, rt.config.server.egress_proxy, os.environ, "upstream")
    url = ws_url(route.url)
    return Upgrade(
        route=route,
        url=url,
        client_headers=headers,
        query=query,
        headers=out,
        user_agent=user_agent,
        subprotocols=list(scope.get("subprotocols") or []),
        dialect=dialect,
        fenced=dialect == dialects.OPENAI_RESPONSES and route.path.endswith("/responses"),
        proxy=None if choice.proxy is None else choice.proxy.url,
        ssl=context if url.startswith("wss://") else None,
    )


async def open_upstream(upgrade: Upgrade) -> ClientConnection:
    """The upstream socket; the one boundary where websockets' errors are translated
    (InvalidStatus passes: the caller relays the upstream's refusal as it is)."""
    up = upgrade.route.upstream
    extra: dict[str, Any] = {} if upgrade.ssl is None else {"ssl": upgrade.ssl}
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
            proxy=upgrade.proxy,
            **extra,
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


def accept_headers(conn: ClientConnection) -> Headers:
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


async def refuse(scope: Message, send: Send, error: StreamfenceError, dialect: str) -> None:
    if not _can_respond(scope):
        await send({"type": "websocket.close", "code": 1008, "reason": error.code})
        return
    body = dialects.error_body(dialect, error)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send(
        {"type": "websocket.http.response.start", "status": error.status, "headers": headers}
    )
    await send({"type": "websocket.http.response.body", "body": body})


async def refuse_with_upstream(scope: Message, send: Send, exc: InvalidStatus) -> None:
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
