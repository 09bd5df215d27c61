"""The ASGI application: the proxy's own endpoints under /_streamfence/ (health, metrics,
the status page), every WebSocket upgrade, and everything else to the proxy endpoint
(`proxy.server.endpoint`).

`create_app(config, transport=..., registry=...)` takes its upstream transport and registry
by injection so tests and benchmarks can swap them; the httpx client is created in the
lifespan, never at import time.
"""

from __future__ import annotations

import asyncio
import logging
import os
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

from proxy import registry as registries
from proxy.config import egress
from proxy.config.schema import Config, OnUnavailable
from proxy.ops import status
from proxy.ops.metrics import scrape_authorized
from proxy.registry import Registry
from proxy.runtime import Runtime
from proxy.server import shutdown
from proxy.server.endpoint import ProxyEndpoint
from proxy.turn.table import Generations
from proxy.upstream.client import create_client, ssl_context_for
from proxy.upstream.routing import RESERVED_PREFIX
from proxy.websocket.endpoint import WebSocketEndpoint

STARTUP_CHECK_SECONDS = 3.0  # the registry's connect and command timeouts are shorter
startup_log = logging.getLogger("streamfence.startup")


def create_app(
    config: Config,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    registry: Registry | None = None,
) -> Starlette:
    runtime = Runtime(config, registry or registries.create(config.registry))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runtime.client = create_client(
            transport,
            config.server.http_transport,
            egress.plan(config, os.environ),
            ssl_context_for(config.server.ca_bundle, os.environ),
        )
        log = runtime.registry.generation_log() if config.registry.follow_across else None
        if log is not None:
            abandoned = runtime.metrics.logs_abandoned
            log.abandoned_hook = lambda reason: abandoned.labels(reason).inc()
        runtime.generations = Generations(
            runtime.client, runtime.registry, runtime.budget, log, runtime.ledger.answered
        )
        await runtime.registry.start()
        await _warn_if_unreachable(runtime.registry, config)
        drain = shutdown.Drain(runtime.active, config.server.shutdown_grace)
        drain.install()  # on SIGTERM: streams still running after the grace get an error event
        try:
            yield
        finally:
            drain.uninstall()
            await runtime.client.aclose()
            await runtime.registry.close()
            if runtime.tracer is not None:
                runtime.tracer.shutdown()  # exports the spans still queued
            drain.report_end()

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        if runtime.client is None:
            return JSONResponse({"status": "not ready"}, 503)
        ok = await runtime.registry.ready()
        return JSONResponse(*readiness(ok, config.registry.on_unavailable))

    async def metrics(request: Request) -> Response:
        if not scrape_authorized(request.headers, runtime.token):
            return PlainTextResponse(
                "access token required\n", 401, headers={"www-authenticate": "Bearer"}
            )
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    async def status_page(request: Request) -> Response:
        return await status.page(request, runtime.token)

    healthy_within = {up.name: up.healthy_within for up in config.upstream}

    async def status_feed(request: Request) -> Response:
        board, active = runtime.status, runtime.active
        return await status.feed(request, runtime.token, board, active, healthy_within)

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
    goes straight to the proxy endpoint: profiled (docs/performance.md), Starlette's
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


def readiness(registry_ok: bool, on_unavailable: OnUnavailable) -> tuple[dict[str, str], int]:
    """/_streamfence/readyz's body and status. With the registry down, fail_open still
    serves (unfenced): ready, so that orchestrators keep sending traffic, but saying so;
    fail_closed refuses keyed requests: not ready."""
    if registry_ok:
        return {"status": "ready"}, 200
    if on_unavailable == OnUnavailable.FAIL_CLOSED:
        return {
            "status": "not ready",
            "registry": "unreachable",
            "detail": "the turn registry does not answer: requests with a turn key are "
            "refused with 503 (on_unavailable = fail_closed)",
        }, 503
    return {
        "status": "degraded",
        "registry": "unreachable",
        "detail": "the turn registry does not answer: requests are forwarded unfenced "
        "(on_unavailable = fail_open)",
    }, 200


async def _warn_if_unreachable(registry: Registry, config: Config) -> None:
    """At startup, not at the first request: a registry that does not answer."""
    try:
        reachable = await asyncio.wait_for(registry.reachable(), STARTUP_CHECK_SECONDS)
    except TimeoutError:
        reachable = False
    if reachable:
        return
    where = config.registry.url.rpartition("@")[2]  # never its password
    then = (
        "requests with a turn key are refused with 503 until it does (fail_closed)"
        if config.registry.on_unavailable == OnUnavailable.FAIL_CLOSED
        else "requests are forwarded unfenced until it does (fail_open)"
    )
    startup_log.warning("the turn registry at %s does not answer: %s", where, then)
