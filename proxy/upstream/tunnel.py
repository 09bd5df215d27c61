"""Connections through an egress proxy, for proxy/upstream/transport.py.

An http:// upstream is reached over a plain connection to the proxy, which then carries
absolute-form requests (`POST http://host:port/path HTTP/1.1`, with Proxy-Authorization).
An https:// upstream is reached through a CONNECT tunnel, with TLS to the upstream inside
it, verified against the upstream's own name. Failures raise httpx's exceptions: a proxy
that cannot be reached or refuses the tunnel is an httpx.ProxyError whose message names
the proxy (never its credentials) and what it answered.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import TypeVar

import httpx

from proxy.config.egress import ProxyURL
from proxy.upstream import causes

P = TypeVar("P", bound=asyncio.Protocol)
MAX_HEAD = 64 * 1024  # a CONNECT answer's head; more is not a proxy talking


class _Handshake(asyncio.Protocol):
    """Reads the proxy's answer to CONNECT, up to the end of its head."""

    def __init__(self) -> None:
        self.buffer = b""
        self.head: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        if self.head.done():
            return
        self.buffer += data
        if b"\r\n\r\n" in self.buffer:
            self.head.set_result(self.buffer)
        elif len(self.buffer) > MAX_HEAD:
            self.head.set_exception(httpx.ProxyError("the egress proxy's answer is too long"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.head.done():
            self.head.set_exception(
                httpx.ProxyError("the egress proxy closed the connection before answering CONNECT")
            )


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect_request(proxy: ProxyURL, host: str, port: int) -> bytes:
    target = _authority(host, port).encode()
    lines = [b"CONNECT %s HTTP/1.1" % target, b"Host: %s" % target]
    if proxy.authorization is not None:
        lines.append(b"Proxy-Authorization: " + proxy.authorization)
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def open_connection(
    proxy: ProxyURL,
    host: str,
    port: int,
    tls: ssl.SSLContext | None,
    factory: Callable[[], P],
    seconds: float | None,
) -> P:
    """A protocol from `factory`, connected to host:port through `proxy`: tunnelled (and
    TLS inside) when `tls` is given, else a plain connection to the proxy itself."""
    loop = asyncio.get_running_loop()
    target = _authority(host, port)
    try:
        async with asyncio.timeout(seconds):
            if tls is None:
                _, protocol = await loop.create_connection(factory, proxy.host, proxy.port)
                return protocol
            transport, shake = await loop.create_connection(_Handshake, proxy.host, proxy.port)
            try:
                transport.write(connect_request(proxy, host, port))
                _check_answer(await shake.head, proxy, target)
                tunnelled = await loop.start_tls(transport, shake, tls, server_hostname=host)
                assert tunnelled is not None
                protocol = factory()
                tunnelled.set_protocol(protocol)
                protocol.connection_made(tunnelled)
                return protocol
            except BaseException:
                transport.close()
                raise
    except TimeoutError:
        raise httpx.ConnectTimeout(
            f"connecting to {target} through the egress proxy {proxy.address} timed out"
        ) from None
    except (ssl.SSLError, ssl.CertificateError) as exc:
        raise httpx.ConnectError(f"TLS to {target} through the egress proxy: {exc}") from exc
    except OSError as exc:
        raise httpx.ProxyError(
            f"could not connect to the egress proxy {proxy.address}: {causes.describe(exc)}"
        ) from exc


def _check_answer(head: bytes, proxy: ProxyURL, target: str) -> None:
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status_line.split(" ", 2)
    ok = len(parts) >= 2 and parts[0].startswith("HTTP/") and parts[1].startswith("2")
    if not ok:
        shown = status_line[:200] if status_line.isprintable() else repr(status_line[:200])
        raise httpx.ProxyError(
            f"the egress proxy {proxy.address} refused CONNECT to {target}: {shown}"
        )
    rest = head.split(b"\r\n\r\n", 1)[1]
    if rest:  # the upstream speaks second in TLS: bytes now are not the upstream's
        raise httpx.ProxyError(f"the egress proxy {proxy.address} sent data after its answer")


def refused_credentials(proxy: ProxyURL) -> httpx.ProxyError:
    """For a 407 to an absolute-form request: the proxy's answer, not the upstream's, so
    not the client's to see as one (a 502 with this cause instead, as for CONNECT)."""
    return httpx.ProxyError(
        f"the egress proxy {proxy.address} answered 407 Proxy Authentication Required"
    )
