"""The upstream HTTP client, and the one boundary where httpx's errors become ours.

The transport is injected (`create_app(config, transport=...)`) so tests and benchmarks
can swap it; the client itself is created in the app's lifespan, never at import time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager

import httpx

from proxy.config import UpstreamConfig
from proxy.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout
from proxy.sse import SSESplitter
from proxy.transport import Transport

# Idle keep-alive connections kept per upstream host, for the next attempt.
MAX_IDLE_CONNECTIONS = 64


class UpstreamClient:
    """Sends the proxy's requests straight to an httpx transport.

    httpx's request and response models and its transport interface are the API; its
    AsyncClient is not used on this path: its `send` merges the client's default headers
    into every request (an upstream would see `accept-encoding: gzip, deflate` and
    `user-agent: python-httpx` that the caller never sent, and could compress a response
    the caller cannot read), keeps cookies across callers, and runs auth, redirect and hook
    machinery the proxy does not want: about a tenth of the CPU of a short request.
    """

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self.transport = transport

    async def send(self, request: httpx.Request, name: str) -> httpx.Response:
        """The response, streaming: its body is read by the caller, who must close it."""
        with translate_errors(name):
            response = await self.transport.handle_async_request(request)
        response.request = request
        return response

    async def aclose(self) -> None:
        await self.transport.aclose()


def create_client(
    transport: httpx.AsyncBaseTransport | None = None, kind: str = "fast"
) -> UpstreamClient:
    """The shared upstream client; `kind` ([server] http_transport) picks the transport
    when none is injected."""
    if transport is None and kind == "fast":
        # Our own HTTP/1.1 transport: httpx's default (httpcore + h11) costs ~110 us of CPU
        # per relayed event; see proxy/transport.py and docs/benchmarks.md.
        transport = Transport(max_idle_per_host=MAX_IDLE_CONNECTIONS)
    if transport is None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        transport = httpx.AsyncHTTPTransport(limits=limits, retries=0)
    return UpstreamClient(transport)


def build_request(
    method: str,
    url: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    upstream: UpstreamConfig,
) -> httpx.Request:
    """The request as the caller sent it (httpx adds only Host and Content-Length), with
    the upstream's timeouts in httpx's transport terms: `read` is the idle timeout, the
    longest silence allowed between two reads."""
    timeout = {
        "connect": upstream.connect_timeout,
        "read": upstream.idle_timeout,
        "write": upstream.idle_timeout,
        "pool": upstream.connect_timeout,
    }
    return httpx.Request(
        method, url, headers=headers, content=body, extensions={"timeout": timeout}
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


def is_event_stream(response: httpx.Response) -> bool:
    ctype: str = response.headers.get("content-type", "")
    return ctype.lower().startswith("text/event-stream")


def event_chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """An SSE body as it arrives. An encoded one must be decoded for its events to be
    found; it then goes out plain."""
    return (
        response.aiter_bytes() if "content-encoding" in response.headers else response.aiter_raw()
    )


async def read_events(
    response: httpx.Response,
    name: str,
    max_event_bytes: int,
    deliver: Callable[[list[bytes]], Awaitable[bool]],
) -> bool:
    """Hands each read's complete events to `deliver`, an unterminated last one at the end.

    False as soon as `deliver` refuses a batch (the relay, fenced); True at the stream's
    end. A malformed stream raises MalformedStream once the good events before it are
    delivered, and a broken exchange raises as ours (translate_errors)."""
    splitter = SSESplitter(max_event_bytes)
    with translate_errors(name):
        async for chunk in event_chunks(response):
            events = splitter.feed(chunk)
            if events and not await deliver(events):
                return False
            if splitter.error is not None:
                raise splitter.error
    tail = splitter.flush()
    if tail and not await deliver(tail):
        return False
    if splitter.error is not None:
        raise splitter.error
    return True
