"""The ASGI application: the proxy's own endpoints under /_streamfence/, and everything
else forwarded through the relay.

`create_app(config, transport=..., registry=...)` takes its upstream transport and registry
by injection so tests and benchmarks can swap them; the httpx client is created in the
lifespan, never at import time. Errors raised before the relay starts are turned into
responses here, in one place, in the caller's dialect.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.types import Receive as ASGIReceive
from starlette.types import Scope
from starlette.types import Send as ASGISend

from proxy import dialects, logs, shutdown, status, turns
from proxy.config import Config
from proxy.errors import BodyTooLarge, NoRoute, StreamfenceError, Unauthorized
from proxy.join import JoinPlan, JoinRelay
from proxy.logs import Record
from proxy.metrics import Metrics
from proxy.registry import MemoryRegistry, Registry
from proxy.relay import Exchange, Receive, Relay, Send, error_response_parts
from proxy.routing import RESERVED_PREFIX, Router, request_headers
from proxy.turnstream import Budget, StreamTable
from proxy.upstream import UpstreamClient, build_request, create_client
from proxy.websocket import WebSocketEndpoint

ACCESS_TOKEN_HEADER = b"x-streamfence-token"
REQUEST_ID_HEADER = b"x-request-id"
LAST_EVENT_ID = b"last-event-id"
log = logging.getLogger("streamfence")


class ClientLeft(Exception):
    """The client disconnected while the proxy was still reading its request."""


class Runtime:
    """What the lifespan creates and every request shares."""

    def __init__(self, config: Config, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.router = Router(config.upstream)
        self.metrics = Metrics()
        registry.unavailable_hook = self.metrics.registry_unavailable.inc
        self.client: UpstreamClient | None = None
        self.turn_header = config.turns.header.lower().encode("latin-1")
        self.drop_headers = {self.turn_header, ACCESS_TOKEN_HEADER}
        self.token = config.server.access_token.encode()
        self.active: set[Relay] = set()  # in flight: for the status page and shutdown
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        budget = Budget(config.server.join_buffer_total_bytes)
        self.join_tables = {
            up.name: StreamTable(up, budget) for up in config.upstream if up.on_retry != "supersede"
        }
        self.status = status.StatusBoard()

    def begin(self, relay: Relay) -> None:
        self.active.add(relay)
        self._idle.clear()
        self.status.changed()

    def end(self, relay: Relay) -> None:
        self.active.discard(relay)
        if not self.active:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until every relay in flight has finished (lease released, record observed):
        a client may hold its whole response a moment before that."""
        await self._idle.wait()

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        if not self.token:
            return True
        given = next((v for n, v in headers if n == ACCESS_TOKEN_HEADER), b"")
        return hmac.compare_digest(given, self.token)

    def finished(self, record: Record, error: StreamfenceError | None) -> None:
        kind = getattr(error, "kind", None)
        self.metrics.observe(record, kind)
        self.metrics.in_flight.dec()
        if record.outcome == "superseded":
            logs.log_supersede(record, self.config.server.log_format)
        logs.log_request(record, self.config.server.log_format)
        self.status.finished(record)


class ProxyEndpoint:
    """Every path outside /_streamfence/: read the request, resolve its turn, relay it."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        rt = self.rt
        rt.metrics.in_flight.inc()
        raw_path = scope.get("raw_path") or scope["path"].encode()
        path = raw_path.decode("latin-1")
        query = scope.get("query_string", b"").decode("latin-1")
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        request_id = _request_id(headers)
        record = Record(method=scope["method"], path=scope["path"], request_id=request_id)
        record.dialect = dialects.detect(path)
        own = [(REQUEST_ID_HEADER, request_id.encode())]
        try:
            exchange, plan = await self._accept(path, query, headers, receive, record, own)
        except ClientLeft:
            record.outcome = "client_gone"
            rt.finished(record, None)
            return
        except StreamfenceError as exc:
            record.outcome, record.status, record.error = "rejected", exc.status, exc.code
            start, body = error_response_parts(exc, record.dialect, own)
            await send(start)
            await send(body)
            rt.finished(record, None)
            return
        assert rt.client is not None
        relay = (
            Relay(exchange, rt.client, rt.registry, record, rt.finished)
            if plan is None
            else JoinRelay(exchange, rt.client, rt.registry, record, rt.finished, plan)
        )
        rt.begin(relay)
        try:
            await relay(scope, receive, send)
        finally:
            rt.end(relay)

    async def _accept(
        self,
        path: str,
        query: str,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
        record: Record,
        own: list[tuple[bytes, bytes]],
    ) -> tuple[Exchange, JoinPlan | None]:
        rt = self.rt
        if path == RESERVED_PREFIX or path.startswith(RESERVED_PREFIX + "/"):
            raise NoRoute("streamfence: no such endpoint under /_streamfence/")
        if not rt.authorized(headers):
            raise Unauthorized(
                "streamfence: this proxy needs its access token in the x-streamfence-token header"
            )
        route = rt.router.route(path, query)
        up = route.upstream
        record.upstream = up.name
        record.dialect = dialects.detect(route.path, up.dialect)
        body = await _read_body(receive, headers, rt.config.server.max_body_bytes)
        turn = turns.resolve(
            headers,
            query,
            body,
            header_name=rt.turn_header,
            route=up.name,
            path=route.path,
            use_fingerprint=up.fingerprint,
            ignore_fields=rt.config.turns.ignore_fields,
        )
        if turn is not None:
            record.turn = turn.short
        assert rt.client is not None
        plan = self._join_plan(up.name, turn, route.path, body, headers)
        drop = rt.drop_headers if plan is None else rt.drop_headers | {LAST_EVENT_ID}
        out_headers = request_headers(headers, drop)
        if not any(n == REQUEST_ID_HEADER for n, _ in out_headers):
            out_headers.append((REQUEST_ID_HEADER, record.request_id.encode()))
        request = build_request(record.method, route.url, out_headers, body, up)
        exchange = Exchange(
            request=request,
            upstream_name=up.name,
            dialect=record.dialect,
            turn=turn,
            max_event_bytes=up.max_event_bytes,
            extra_headers=own,
            write_timeout=rt.config.server.write_timeout,
        )
        return exchange, plan

    def _join_plan(
        self,
        name: str,
        turn: turns.TurnKey | None,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> JoinPlan | None:
        """For join/adaptive upstreams: what the join relay needs (None: supersede)."""
        table = self.rt.join_tables.get(name)
        if table is None or turn is None:
            return None
        body_hash = turn.body_fingerprint or turns.fingerprint(
            name, path, body, self.rt.config.turns.ignore_fields
        )
        if body_hash is None:
            return None
        raw = next((v for n, v in headers if n == LAST_EVENT_ID), None)
        last_event_id = int(raw) if raw is not None and raw.strip().isdigit() else None
        return JoinPlan(table, body_hash, last_event_id)


def _request_id(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == REQUEST_ID_HEADER and 0 < len(value) <= 128 and value.isascii():
            text = value.decode()
            if text.isprintable():
                return text
    return uuid.uuid4().hex


async def _read_body(receive: Receive, headers: list[tuple[bytes, bytes]], limit: int) -> bytes:
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise BodyTooLarge(f"streamfence: the request body is over the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"streamfence: the request body is over the {limit}-byte limit")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def create_app(
    config: Config,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    registry: Registry | None = None,
) -> Starlette:
    runtime = Runtime(config, registry or _make_registry(config))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runtime.client = create_client(transport, config.server.http_transport)
        await runtime.registry.start()
        drain = shutdown.Drain(runtime.active, config.server.shutdown_grace)
        drain.install()  # on SIGTERM: streams still running after the grace get an error event
        try:
            yield
        finally:
            drain.uninstall()
            await runtime.client.aclose()
            await runtime.registry.close()

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ok = runtime.client is not None and await runtime.registry.ready()
        return JSONResponse({"status": "ready" if ok else "not ready"}, 200 if ok else 503)

    async def metrics(request: Request) -> Response:
        if not runtime.authorized(request.scope["headers"]):
            return PlainTextResponse("access token required\n", 401)
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    async def status_page(request: Request) -> Response:
        return await status.page(request, runtime.token)

    async def status_feed(request: Request) -> Response:
        return await status.feed(request, runtime.token, runtime.status, runtime.active)

    own_routes = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
        Route("/", status_page),
        Route("/feed", status_feed),
    ]
    app = _App(
        ProxyEndpoint(runtime),
        routes=[Mount(RESERVED_PREFIX, routes=own_routes)],
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    return app


class _App(Starlette):
    """Starlette for the proxy's own endpoints (/_streamfence/...); every other request
    goes straight to the proxy endpoint: profiled (docs/benchmarks.md), Starlette's
    middleware and routing layers wrapped every relayed write. What they add, error pages
    and routing, the endpoint does itself (a bare /_streamfence included: 404)."""

    def __init__(self, proxy: ProxyEndpoint, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.proxy = proxy
        self.websocket = WebSocketEndpoint(proxy.rt)  # every upgrade: relayed or refused

    async def __call__(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "http" and not scope["path"].startswith(RESERVED_PREFIX + "/"):
            await self.proxy(scope, receive, send)  # type: ignore[arg-type]  # dicts at runtime
            return
        if scope["type"] == "websocket":
            await self.websocket(scope, receive, send)  # type: ignore[arg-type]
            return
        await super().__call__(scope, receive, send)


def _make_registry(config: Config) -> Registry:
    if config.registry.backend == "redis":
        from proxy.registry.redis import RedisRegistry  # noqa: PLC0415 - optional backend

        return RedisRegistry(config.registry)
    return MemoryRegistry()
