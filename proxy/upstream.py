"""The upstream HTTP client, and the one boundary where httpx's errors become ours.

The transport is injected (`create_app(config, transport=...)`) so tests and benchmarks
can swap it; the client itself is created in the app's lifespan, never at import time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import httpx

from proxy.config import UpstreamConfig
from proxy.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout
from proxy.transport import Transport

# Idle keep-alive connections kept per upstream host, for the next attempt.
MAX_IDLE_CONNECTIONS = 64


def create_client(
    transport: httpx.AsyncBaseTransport | None = None, kind: str = "fast"
) -> httpx.AsyncClient:
    """The shared upstream client; `kind` ([server] http_transport) picks the transport
    when none is injected."""
    if transport is None and kind == "fast":
        # Our own HTTP/1.1 transport: httpx's default (httpcore + h11) costs ~110 us of CPU
        # per relayed event; see proxy/transport.py and docs/benchmarks.md.
        transport = Transport(max_idle_per_host=MAX_IDLE_CONNECTIONS)
    if transport is None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        transport = httpx.AsyncHTTPTransport(limits=limits, retries=0)
    # trust_env=False: no proxy variables or .netrc credentials are picked up silently.
    return _Client(
        transport=transport,
        follow_redirects=False,
        trust_env=False,
        timeout=None,
    )


class _NoCookies(httpx.Cookies):
    """A jar that keeps nothing. The client is shared by every caller: a cookie one
    upstream response set must not ride along on another caller's request (Set-Cookie
    still reaches the caller that got it), and extracting cookies costs CPU per request."""

    def extract_cookies(self, response: httpx.Response) -> None:
        pass

    def set_cookie_header(self, request: httpx.Request) -> None:
        pass


class _Client(httpx.AsyncClient):
    _no_cookies = _NoCookies()

    @property
    def cookies(self) -> httpx.Cookies:
        return self._no_cookies

    @cookies.setter
    def cookies(self, cookies: object) -> None:
        pass  # httpx's constructor sets it; nothing is ever kept


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


def is_event_stream(response: httpx.Response) -> bool:
    ctype: str = response.headers.get("content-type", "")
    return ctype.lower().startswith("text/event-stream")


def event_chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """An SSE body as it arrives. An encoded one must be decoded for its events to be
    found; it then goes out plain."""
    return (
        response.aiter_bytes() if "content-encoding" in response.headers else response.aiter_raw()
    )
