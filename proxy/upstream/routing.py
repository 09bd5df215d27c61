"""Which upstream a request goes to, and which headers cross the proxy.

Routing uses the request path alone: neither `Host` nor an absolute-form target ever picks
the destination, so the proxy only reaches the upstreams in its config (no open proxy, no
SSRF). Pure and I/O-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proxy.asgi import Headers
from proxy.config.schema import UpstreamConfig
from proxy.errors import BadRequest, NoRoute
from proxy.wire import codings

RESERVED_PREFIX = "/_streamfence"

# RFC 9110 section 7.6.1, plus the de-facto ones proxies also drop.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Set by the HTTP client for the upstream hop itself.
_REQUEST_OWN = frozenset({b"host", b"content-length", b"expect"})


@dataclass(frozen=True, slots=True)
class Route:
    upstream: UpstreamConfig
    path: str  # the upstream-side path, prefix stripped, still percent-encoded
    url: str


class Router:
    def __init__(self, upstreams: Sequence[UpstreamConfig]) -> None:
        # Longest prefix first, so the first match is the most specific.
        self._upstreams = sorted(upstreams, key=lambda u: len(u.prefix.rstrip("/")), reverse=True)

    def route(self, raw_path: str, query: str) -> Route:
        # An encoded dot is a dot to the upstream (RFC 3986 section 6.2.2.2): "%2e%2e" must
        # not climb out of an upstream's base path where ".." may not.
        dotted = raw_path.replace("%2e", ".").replace("%2E", ".") + "/"
        if "/../" in dotted or "/./" in dotted:
            raise BadRequest("streamfence: the request path must not contain dot segments")
        for upstream in self._upstreams:
            rest = _strip_prefix(upstream.prefix, raw_path)
            if rest is not None:
                return Route(upstream, rest, build_url(upstream.url, rest, query))
        raise NoRoute(f"streamfence: no upstream is configured for the path {raw_path!r}")


def _strip_prefix(prefix: str, path: str) -> str | None:
    prefix = prefix.rstrip("/")
    if not prefix:
        return path
    if path == prefix:
        return "/"
    if path.startswith(prefix + "/"):
        return path[len(prefix) :]
    return None


def build_url(base: str, path: str, query: str) -> str:
    url = base.rstrip("/") + path
    return f"{url}?{query}" if query else url


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b","))
    return tokens


def request_headers(headers: Headers, drop: Iterable[bytes] = ()) -> Headers:
    """The client's headers as they go upstream.

    ASGI servers give lower-case names, but nothing here relies on it. `Expect` is dropped:
    the proxy's server already answered `100-continue` when the body was read, and the
    body goes upstream whole. `Accept-Encoding` offers only what the proxy can decode, in
    case the answer is an event stream it has to read (codings.offer)."""
    dropped = HOP_BY_HOP | _REQUEST_OWN | _connection_tokens(headers) | {d.lower() for d in drop}
    out: Headers = []
    for name, value in headers:
        lname = name.lower()
        if lname in dropped:
            continue
        if lname == b"accept-encoding":
            value = codings.offer(value)
        out.append((name, value))
    return out


# The relay sets its own on an event stream (relay.SSE_HEADERS): one of each reaches the client.
_REFRAMED = frozenset(
    {b"content-length", b"content-encoding", b"cache-control", b"x-accel-buffering"}
)


def response_headers(headers: Headers, *, reframed: bool) -> Headers:
    """The upstream's headers as they go back to the client, names lower-cased (as ASGI
    wants them; Go, Node and nginx capitalise).

    When the proxy re-frames the body (SSE: it decodes it and may end the stream with its
    own frame), the upstream's length and encoding no longer describe what the client gets,
    and the relay's own cache-control and x-accel-buffering replace the upstream's.
    """
    dropped = HOP_BY_HOP | _connection_tokens(headers)
    if reframed:
        dropped = dropped | _REFRAMED
    out: Headers = []
    for name, value in headers:
        lname = name.lower()
        if lname not in dropped:
            out.append((lname, value))
    return out
