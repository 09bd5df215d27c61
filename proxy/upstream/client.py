"""The upstream HTTP client, and the one boundary where httpx's errors become ours.

The transport is injected (`create_app(config, transport=...)`) so tests and benchmarks
can swap it; the client itself is created in the app's lifespan, never at import time.
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import httpx

from proxy.config.egress import EgressPlan, ProxyURL
from proxy.config.schema import HttpTransport, UpstreamConfig
from proxy.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout
from proxy.upstream import causes, tunnel
from proxy.upstream.transport import Body, Transport
from proxy.wire.sse import SSESplitter

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
        """The response, streaming: its body is read by the caller, who must close it.
        Reading it raises the project's errors (UpstreamError), as sending does."""
        address = _address(request.url)
        with translate_errors(name, address):
            response = await self.transport.handle_async_request(request)
        response.request = request
        if isinstance(response.stream, httpx.AsyncByteStream):  # every transport's is
            response.stream = _TranslatedBody(response.stream, name, address)
        return response

    async def aclose(self) -> None:
        await self.transport.aclose()


class _TranslatedBody(httpx.AsyncByteStream):
    """A response body whose failures (reset, read timeout, early end) are ours, with
    their cause and the upstream's address: translated where the body is read, once."""

    def __init__(self, inner: httpx.AsyncByteStream, name: str, address: str) -> None:
        self.inner = inner
        self.name = name
        self.address = address

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with translate_errors(self.name, self.address):
            async for chunk in self.inner:
                yield chunk

    async def aclose(self) -> None:
        with translate_errors(self.name, self.address):
            await self.inner.aclose()


def _own_body(response: httpx.Response) -> tuple[Body, str] | None:
    """The body of a response from our transport (proxy/upstream/transport.py) and the upstream's
    address, else None."""
    stream = response.stream
    if isinstance(stream, _TranslatedBody) and isinstance(stream.inner, Body):
        return stream.inner, stream.address
    return None


def abort(response: httpx.Response) -> bool:
    """Close a streaming response's connection at once, without awaiting, where the
    transport allows it (ours): True if it did. The response must still be closed."""
    own = _own_body(response)
    if own is not None:
        own[0].conn.abort()
    return own is not None


def _address(url: httpx.URL) -> str:
    port = url.port or (443 if url.scheme == "https" else 80)
    host = url.host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def create_client(
    transport: httpx.AsyncBaseTransport | None = None,
    kind: HttpTransport = HttpTransport.FAST,
    egress: EgressPlan | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> UpstreamClient:
    """The shared upstream client; `kind` ([server] http_transport) picks the transport
    when none is injected, `egress` its proxies, `ssl_context` its CA certificates."""
    egress = egress or EgressPlan()
    if transport is None and kind == HttpTransport.FAST:
        # Our own HTTP/1.1 transport: httpx's default (httpcore + h11) costs several times
        # the CPU per relayed event (proxy/upstream/transport.py; docs/performance.md).
        transport = Transport(
            max_idle_per_host=MAX_IDLE_CONNECTIONS, ssl_context=ssl_context, egress=egress
        )
    if transport is None:
        # httpx's own: one transport for all, unless some upstreams go through a proxy.
        proxies = egress.proxies()
        direct = _httpx_transport(None, ssl_context)
        transport = HttpxTransports(egress, direct, ssl_context) if proxies else direct
    return UpstreamClient(transport)


def _httpx_transport(
    proxy: ProxyURL | None, ssl_context: ssl.SSLContext | None
) -> httpx.AsyncHTTPTransport:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    return httpx.AsyncHTTPTransport(
        limits=limits,
        retries=0,
        verify=ssl_context if ssl_context is not None else True,
        proxy=None if proxy is None else httpx.Proxy(proxy.url),
    )


class HttpxTransports(httpx.AsyncBaseTransport):
    """httpx's transports, one direct and one per egress proxy in use: each request goes
    to the one its upstream's origin is reached through."""

    def __init__(
        self,
        egress: EgressPlan,
        direct: httpx.AsyncHTTPTransport,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.egress = egress
        self.direct = direct
        self.via = {proxy: _httpx_transport(proxy, ssl_context) for proxy in egress.proxies()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        port = url.port or (443 if url.scheme == "https" else 80)
        proxy = self.egress.proxy_for(url.scheme, url.host, port)
        if proxy is None:
            return await self.direct.handle_async_request(request)
        response = await self.via[proxy].handle_async_request(request)
        if response.status_code == 407 and url.scheme == "http":
            await response.aclose()
            raise tunnel.refused_credentials(proxy)
        return response

    def in_use(self) -> int:
        """Connections carrying a response not yet closed (for leak checks)."""
        pools = [t._pool for t in [self.direct, *self.via.values()]]
        return sum(1 for p in pools for c in p.connections if not (c.is_idle() or c.is_closed()))

    async def aclose(self) -> None:
        for transport in [self.direct, *self.via.values()]:
            await transport.aclose()


def ssl_context_for(ca_bundle: str, environ: Mapping[str, str]) -> ssl.SSLContext | None:
    """The CA certificates upstreams are verified with: `[server] ca_bundle`, else
    SSL_CERT_FILE, else SSL_CERT_DIR; None for each transport's default. ValueError naming
    the setting when its certificates cannot be loaded."""
    cafile = capath = None
    if ca_bundle:
        where = "server.ca_bundle"
        cafile, capath = (None, ca_bundle) if os.path.isdir(ca_bundle) else (ca_bundle, None)
    elif environ.get("SSL_CERT_FILE"):
        where, cafile = "SSL_CERT_FILE", environ["SSL_CERT_FILE"]
    elif environ.get("SSL_CERT_DIR"):
        where, capath = "SSL_CERT_DIR", environ["SSL_CERT_DIR"]
    else:
        return None
    try:
        context = ssl.create_default_context(cafile=cafile, capath=capath)
    except (OSError, ssl.SSLError) as exc:
        shown = cafile or capath
        raise ValueError(f"{where}: cannot load CA certificates from {shown!r}: {exc}") from None
    context.set_alpn_protocols(["http/1.1"])
    return context


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
    parsed = _parsed(url)
    # What httpx itself would add, in its order, without its header encoding detection
    # and content sniffing (with the URL parsing, a tenth of the CPU of a short request):
    # Host first, the caller's headers, then Content-Length where httpx sends one.
    out = [(b"Host", parsed.netloc), *headers]
    if body or method in ("POST", "PUT", "PATCH"):
        out.append((b"Content-Length", b"%d" % len(body)))
    request = httpx.Request(
        method, parsed, headers=out, stream=httpx.ByteStream(body), extensions={"timeout": timeout}
    )
    request.read()  # `request.content`, as with content=: the body is in memory already
    return request


@functools.lru_cache(maxsize=256)
def _parsed(url: str) -> httpx.URL:
    # httpx parses a URL in Python, a visible share of a short request's CPU; an agent asks
    # the same few URLs over and over. (httpx.URL is immutable: a Request shares it.)
    return httpx.URL(url)


def translate_errors(name: str, address: str = "") -> _Translating:
    """httpx's exceptions, as the project's own (errors.UpstreamError and subclasses),
    each with its cause for the log line (causes.describe)."""
    return _Translating(name, address)


class _Translating:
    """translate_errors' context manager: a class, not @contextmanager's generator, as it
    wraps every request three times (its send, its body, its close)."""

    __slots__ = ("address", "name")

    def __init__(self, name: str, address: str) -> None:
        self.name = name
        self.address = address

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, httpx.HTTPError):
            raise _translated(exc, self.name, self.address) from exc


def _translated(exc: httpx.HTTPError, name: str, address: str) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException):
        what = "connect" if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout) else "respond"
        return UpstreamTimeout(
            f"streamfence: upstream {name!r} did not {what} within the configured timeout",
            causes.describe(exc, address),
        )
    if isinstance(exc, httpx.ConnectError | httpx.UnsupportedProtocol | httpx.ProxyError):
        return UpstreamConnectError(
            f"streamfence: could not connect to upstream {name!r} ({causes.kind(exc)})",
            causes.describe(exc, address),
        )
    return UpstreamError(
        f"streamfence: upstream {name!r} broke the HTTP exchange ({type(exc).__name__})",
        causes.describe(exc, address),
    )


def is_event_stream(response: httpx.Response) -> bool:
    return is_event_stream_type(response.headers.get("content-type", ""))


def is_event_stream_type(content_type: str) -> bool:
    return content_type.lower().startswith("text/event-stream")


def _event_reader(
    response: httpx.Response,
) -> tuple[Callable[[], Awaitable[bytes]], Callable[[], bool], str]:
    """How an SSE body is read as it arrives, whether it is known to be read to its end,
    and the upstream's address for its errors. An encoded one must be decoded for its
    events to be found; it then goes out plain."""
    encoded = "content-encoding" in response.headers
    own = None if encoded else _own_body(response)
    if own is not None:
        # Our transport's body, read directly rather than through three async generators
        # (httpx's, _TranslatedBody's, its own): a relayed event is one read. Its errors are
        # translated once, around the caller's loop.
        body, address = own
        return body.read, body.at_end, address
    chunks = aiter(response.aiter_bytes() if encoded else response.aiter_raw())

    async def read() -> bytes:
        return await anext(chunks, b"")

    return read, lambda: False, ""


async def read_events(
    response: httpx.Response,
    name: str,
    max_event_bytes: int,
    deliver: Callable[[list[bytes], bool], Awaitable[bool]],
) -> bool:
    """Hands each read's complete events to `deliver`, an unterminated last one at the end;
    its flag says the batch is the stream's last and its body is all in (so that a client's
    response can end with it, in one write).

    False as soon as `deliver` refuses a batch (the relay, fenced); True at the stream's
    end. A malformed stream raises MalformedStream once the good events before it are
    delivered, and a broken exchange raises as ours (translate_errors)."""
    splitter = SSESplitter(max_event_bytes)
    read, at_end, address = _event_reader(response)
    with translate_errors(name, address):
        while chunk := await read():
            events = splitter.feed(chunk)
            if events:
                last = at_end() and not splitter.holding and splitter.error is None
                if not await deliver(events, last):
                    return False
            if splitter.error is not None:
                raise splitter.error
    tail = splitter.flush()
    if tail and not await deliver(tail, False):
        return False
    if splitter.error is not None:
        raise splitter.error
    return True
