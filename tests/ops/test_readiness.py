"""/_streamfence/readyz and the startup check of the registry, against a real redis-server
and a port nobody listens on: under fail_open a registry that does not answer is a 200 that
says "degraded" (the proxy forwards unfenced), under fail_closed a 503; startup warns at
once, not at the first request."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from proxy.registry.redis import RedisRegistry
from tests.conftest import ProxyFactory
from tests.redis_server import RedisServer
from tests.scripted import ScriptedUpstream, free_port

STARTUP = "streamfence.startup"


def _unreachable(**extra: Any) -> dict[str, Any]:
    # A password in the URL: the warning names where, never the credential.
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    return {"registry.backend": "redis", "registry.url": url, **extra}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == STARTUP and r.levelno >= logging.WARNING
    ]


async def test_fail_open_with_the_registry_down_is_ready_but_says_it_is_degraded(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=STARTUP)
    async with make_proxy(upstream.url, **_unreachable()) as proxy, proxy.client() as client:
        # Warned at startup, before any request.
        (warning,) = _warnings(caplog)
        assert warning.startswith("the turn registry at 127.0.0.1:")
        assert warning.endswith(
            "does not answer: requests are forwarded unfenced until it does (fail_open)"
        )
        assert "hunter2" not in warning
        ready = await client.get("/_streamfence/readyz")
        served = await client.post("/v1/chat/completions", json={"model": "m"})
    # Still in rotation (availability first), but not claiming all is well: the README said
    # 503 and the body said "ready" while nothing was fenced.
    assert ready.status_code == 200
    body = ready.json()
    assert (body["status"], body["registry"]) == ("degraded", "unreachable")
    assert "forwarded unfenced" in body["detail"]
    assert served.status_code == 200


async def test_fail_closed_with_the_registry_down_is_not_ready(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=STARTUP)
    closed = _unreachable(**{"registry.on_unavailable": "fail_closed"})
    async with make_proxy(upstream.url, **closed) as proxy, proxy.client() as client:
        (warning,) = _warnings(caplog)
        assert warning.endswith("refused with 503 until it does (fail_closed)")
        ready = await client.get("/_streamfence/readyz")
    assert ready.status_code == 503
    body = ready.json()
    assert (body["status"], body["registry"]) == ("not ready", "unreachable")
    assert "refused with 503" in body["detail"]


@pytest.mark.parametrize("on_unavailable", ["fail_open", "fail_closed"])
async def test_with_redis_answering_it_is_ready_and_startup_is_quiet(
    upstream: ScriptedUpstream,
    make_proxy: ProxyFactory,
    single_redis: RedisServer,
    caplog: pytest.LogCaptureFixture,
    on_unavailable: str,
) -> None:
    caplog.set_level(logging.INFO, logger=STARTUP)
    overrides = {
        "registry.backend": "redis",
        "registry.url": single_redis.url,
        "registry.on_unavailable": on_unavailable,
    }
    async with make_proxy(upstream.url, **overrides) as proxy, proxy.client() as client:
        registry = proxy.runtime.registry
        assert isinstance(registry, RedisRegistry)
        await asyncio.wait_for(registry.wait_subscribed(), 10)
        ready = await client.get("/_streamfence/readyz")
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
    assert _warnings(caplog) == []


async def test_with_the_in_process_registry_it_is_ready_and_startup_is_quiet(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # The default backend has nothing to reach: no warning, and ready from the start.
    caplog.set_level(logging.INFO, logger=STARTUP)
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        ready = await client.get("/_streamfence/readyz")
    assert proxy.runtime.config.registry.backend == "memory"
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
    assert _warnings(caplog) == []
