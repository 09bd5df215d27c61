from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from proxy.config.load import load
from proxy.runtime import Runtime
from proxy.server.app import create_app
from proxy.server.listen import Loop
from proxy.server.serve import uvicorn_options
from tests.redis_server import (  # noqa: F401 - fixtures: a Redis server, or a cluster
    cluster_server,
    redis_server,
    restartable_redis,
    shared_cluster,
    single_redis,
)
from tests.scripted import ScriptedUpstream, serve

# Every test ends within its bound, teardown included (tests/bounds.py).
pytest_plugins = ["tests.bounds"]


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    # Every coroutine test runs under anyio (asyncio backend). Marked at collection, before
    # parametrization, so that @pytest.mark.parametrize still applies.
    if inspect.iscoroutinefunction(obj) and name.startswith("test"):
        pytest.mark.anyio(obj)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# The loop `streamfence` itself runs on (uvloop, with proxy/server/listen.py's accept loop): the
# suites of real clients and agents run on it, so that every connection they make goes
# through that accept loop, as it does in production, and not only the CLI tests' ones.
PROXY_LOOP = ("asyncio", {"loop_factory": Loop})


EGRESS_ENV = [f"{n}_proxy" for n in ("http", "https", "all", "no")]
EGRESS_ENV += [n.upper() for n in EGRESS_ENV]


@pytest.fixture(autouse=True)
def _no_egress_proxy_from_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    # The proxy reads HTTPS_PROXY & co. (proxy/config/egress.py): a CI machine's own must not send
    # the tests' loopback traffic elsewhere. Egress tests set theirs explicitly.
    for name in EGRESS_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    scripted = ScriptedUpstream()
    async with serve(scripted) as (url, _server):
        scripted.url = url
        yield scripted


@dataclass
class Proxy:
    url: str
    runtime: Runtime

    def client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10, **kw)


ProxyFactory = Callable[..., AbstractAsyncContextManager[Proxy]]


@pytest.fixture
def make_proxy() -> ProxyFactory:
    @asynccontextmanager
    async def start(upstream_url: str, **overrides: Any) -> AsyncIterator[Proxy]:
        flat = {"upstream.url": upstream_url, **overrides}
        app_kw = flat.pop("_app", {})  # before load(): it is not a config key
        config = load(env={}, overrides=flat)
        app = create_app(config, **app_kw)
        # HTTP and WebSocket protocols as the CLI serves them (tests/scripted.py's defaults
        # are uvicorn's httptools protocol and ws="none").
        options = uvicorn_options(config)
        protocols = {key: options[key] for key in ("http", "ws", "ws_max_size")}
        escaped: list[BaseException] = []

        async def guarded(scope: Any, receive: Any, send: Any) -> None:
            # An error out of the app reaches no client (the server logs it, closes the
            # connection): the test could pass with it. Any is a failure of the test.
            try:
                await app(scope, receive, send)
            except Exception as exc:
                escaped.append(exc)
                raise

        async with serve(guarded, **protocols) as (url, _server):
            yield Proxy(url, app.state.runtime)
        if escaped:
            pytest.fail(f"the proxy's app raised, and the server swallowed it: {escaped!r}")

    return start


@pytest.fixture
async def proxy(upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> AsyncIterator[Proxy]:
    async with make_proxy(upstream.url) as p:
        yield p
