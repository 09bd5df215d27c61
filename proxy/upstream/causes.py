"""Why an upstream exchange failed, in words for the request's log line.

nginx and Caddy log the errno and the address; so does streamfence: "127.0.0.1:8080:
connection refused", "api.example.com:443: name not resolved (Name or service not known)",
"...: TLS verification failed: certificate has expired". The cause is found on the chain of
exceptions under httpx's (both transports raise httpx's from the OS's and ssl's). Never a
credential: URLs' userinfo is cut from every text shown. Pure and I/O-free.
"""

from __future__ import annotations

import os
import re
import socket
import ssl

import httpx

from proxy import errors

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]*@")


def scrub(text: str) -> str:
    """`text` without any user:password@ of a URL in it."""
    return _USERINFO.sub(r"\1", text)


def _reason(exc: BaseException) -> str | None:
    """The words for one exception of the chain, None when it says nothing specific."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS verification failed: {exc.verify_message or exc.reason}"
    if isinstance(exc, ssl.CertificateError):
        return f"TLS verification failed: {exc}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {exc.reason or exc}"
    if isinstance(exc, socket.gaierror):
        return f"name not resolved ({exc.strerror or exc})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    if isinstance(exc, httpx.ProxyError):
        return str(exc) or "the egress proxy failed"
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        proxied = "egress proxy" in str(exc)  # tunnel.open_connection's
        return "connect timeout through the egress proxy" if proxied else "connect timeout"
    if isinstance(exc, httpx.ReadTimeout):
        return "read timeout"
    if isinstance(exc, httpx.WriteTimeout):
        return "write timeout"
    if isinstance(exc, httpx.DecodingError):
        return f"could not decode the body: {exc}"
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower()
    return None


_SPECIFIC_FIRST = (httpx.ProxyError, httpx.TimeoutException)


def describe(exc: BaseException, address: str = "") -> str:
    """ "host:port: what went wrong" for the log line."""
    chain = list(errors.chain(exc))
    # A timeout or a proxy failure is itself the cause; otherwise the deepest specific
    # error says most (a ConnectError over a gaierror: name not resolved).
    top = next((e for e in chain if isinstance(e, _SPECIFIC_FIRST)), None)
    reason = _reason(top) if top is not None else None
    if reason is None:
        reason = next((r for e in chain if (r := _reason(e)) is not None), None)
    if reason is None:
        text = str(exc)
        reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return scrub(f"{address}: {reason}" if address else reason)


def kind(exc: BaseException) -> str:
    """A short cause for the client's error message: the reason without its details."""
    reason = describe(exc)
    for short in (
        "connection refused",
        "name not resolved",
        "TLS verification failed",
        "TLS handshake failed",
        "connection reset",
        "connect timeout",
        "egress proxy",
    ):
        if short in reason:
            return short
    return type(exc).__name__
