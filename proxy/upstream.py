"""The upstream HTTP client, and the one boundary where httpx's errors become ours.

The transport is injected (`create_app(config, transport=...)`) so tests and benchmarks
can swap it; the client itself is created in the app's lifespan, never at import time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from proxy.config import UpstreamConfig
from proxy.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout

# httpx's pool checks every idle keep-alive connection on each request; a small cap keeps
# that cheap while still reusing connections for the next attempt.
MAX_IDLE_CONNECTIONS = 32


def create_client(transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=MAX_IDLE_CONNECTIONS)
    if transport is None:
        transport = httpx.AsyncHTTPTransport(limits=limits, retries=0)
    # trust_env=False: no proxy variables or .netrc credentials are picked up silently.
    return httpx.AsyncClient(
        transport=transport,
        limits=limits,
        follow_redirects=False,
        trust_env=False,
        timeout=None,
    )


def timeout_for(upstream: UpstreamConfig) -> httpx.Timeout:
    # `read` is the idle timeout: the longest silence allowed between two reads.
    return httpx.Timeout(
        connect=upstream.connect_timeout,
        read=upstream.idle_timeout,
        write=upstream.idle_timeout,
        pool=upstream.connect_timeout,
    )


@contextmanager
def translate_errors(name: str) -> Iterator[None]:
    """httpx's exceptions, as the project's own (errors.UpstreamError and subclasses)."""
    try:
        yield
    except httpx.TimeoutException as exc:
        what = "connect" if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout) else "respond"
        raise UpstreamTimeout(
            f"streamfence: upstream {name!r} did not {what} within the configured timeout"
        ) from exc
    except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
        raise UpstreamConnectError(
            f"streamfence: could not connect to upstream {name!r} ({type(exc).__name__})"
        ) from exc
    except httpx.HTTPError as exc:
        raise UpstreamError(
            f"streamfence: upstream {name!r} broke the HTTP exchange ({type(exc).__name__})"
        ) from exc


async def send(client: httpx.AsyncClient, request: httpx.Request, name: str) -> httpx.Response:
    with translate_errors(name):
        return await client.send(request, stream=True)
