"""`streamfence serve`: bind the listening socket, say so, and run uvicorn on it.

The socket is bound (and listening) before anything is printed, so "listening on" is true
when it appears, and a port already in use is one line with the fix instead of uvicorn's
bind error after a banner that lied. Connections that arrive before uvicorn's loop runs wait
in the socket's backlog.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from proxy import __version__
from proxy.config import egress
from proxy.config.load import from_dict
from proxy.config.schema import Backend, Config, LogFormat
from proxy.ops import logs, tracing
from proxy.server import hooks, shutdown

if TYPE_CHECKING:
    from starlette.applications import Starlette

WORKER_ENV = "_STREAMFENCE_WORKER_CONFIG"  # not STREAMFENCE_*: that prefix is config keys
BACKLOG = 2048  # uvicorn's default
log = logging.getLogger("streamfence")
startup_log = logging.getLogger("streamfence.startup")


class BindError(Exception):
    """The listening socket could not be made; the message is the whole explanation."""


def bind(host: str, port: int) -> socket.socket:
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # IPv6 only for an IPv6 address, as uvicorn does: "localhost" must not end up on ::1
    # alone while clients dial 127.0.0.1.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, family, socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise BindError(
            f"cannot listen on {where}: unknown host ({exc.strerror}); set --host"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {where}: {_why(exc)}") from None
    sock.set_inheritable(True)  # for uvicorn's worker processes
    return sock


def _why(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            "the port is already in use (another streamfence?); "
            "choose another with --port (or STREAMFENCE_SERVER_PORT)"
        )
    if exc.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges); choose another with --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "that address is not on this machine; choose another with --host"
    return f"{exc.strerror or exc}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _without_userinfo(url: str) -> str:
    # A user:password in an upstream URL is a credential: never print it.
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    return f"{scheme}{sep}{authority.rpartition('@')[2]}{slash}{path}"


def startup_lines(
    config: Config,
    port: int | None = None,
    verb: str = "listening on",
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """What the process is about to do. `port`: the bound one (for port 0); `verb`: what
    check-config says instead, since it listens nowhere; `environ`: for the egress proxy."""
    s = config.server
    host = f"[{s.host}]" if ":" in s.host else s.host
    lines = [f"streamfence {__version__} {verb} http://{host}:{s.port if port is None else port}"]
    if s.workers > 1:
        lines[0] += f" ({s.workers} workers)"
    for up in config.upstream:
        url = _without_userinfo(up.url)
        lines.append(f"  upstream {up.name!r}: {up.prefix} -> {url} (dialect {up.dialect})")
    lines += egress.startup_lines(config, os.environ if environ is None else environ)
    if s.ca_bundle:
        lines.append(f"  upstream CA certificates: {s.ca_bundle}")
    reg = config.registry
    where = ""
    if reg.backend == Backend.REDIS:
        where = f" at {reg.url.split('@')[-1]} ({reg.on_unavailable} when unreachable)"
    lines.append(f"  registry: {reg.backend}{where}")
    lines += hooks.startup_warnings()
    if not _is_loopback(s.host) and not s.access_token:
        lines.append(
            f"WARNING: {verb} {s.host}, which is not a loopback address, with no access "
            "token: anyone who can reach this port can use your upstream credentials' "
            "turns. Set [server] access_token or --access-token."
        )
    return lines


def announce(lines: list[str], fmt: LogFormat) -> None:
    """The startup lines through the log, so that in JSON mode they are JSON too."""
    for line in lines:
        if line.startswith("WARNING: "):
            startup_log.warning(line.removeprefix("WARNING: "))
        else:
            startup_log.info(line if fmt == LogFormat.TEXT else line.strip())


def uvicorn_options(config: Config) -> dict[str, Any]:
    """How uvicorn runs the proxy, in one process or in each worker."""
    return dict(
        loop="proxy.server.listen:Loop",  # uvloop, accepting every pending connection at a wake-up
        # httptools, each request's first step taken as soon as it is read (where the hooks
        # for it exist: proxy/server/hooks.py)
        http=hooks.http_protocol(),
        ws="websockets-sansio",  # WebSocket mode (proxy/websocket/endpoint.py)
        ws_max_size=config.server.websocket_max_message_bytes + 1,  # the app says 1009 itself
        lifespan="on",
        access_log=False,
        log_config=None,  # logs.configure routes uvicorn's loggers through our format
        server_header=False,  # the upstream's own date and server headers pass through
        date_header=False,
        # The proxy never reads a caller's address or scheme: uvicorn's X-Forwarded-*
        # middleware only wrapped every request (a percent of a short one's instructions).
        proxy_headers=False,
        # Later than the app's own deadline (proxy.server.shutdown), which ends streams cleanly.
        timeout_graceful_shutdown=shutdown.uvicorn_timeout(config.server.shutdown_grace),
    )


def serve(config: Config, log_level: str) -> int:
    import uvicorn  # noqa: PLC0415 - keep `--help` and check-config fast

    # "auto" decided once, here, for the whole process and its workers (they share stderr).
    fmt = logs.resolve_format(config.server.log_format, sys.stderr)
    config = dataclasses.replace(config, server=dataclasses.replace(config.server, log_format=fmt))
    logs.configure(log_level, fmt)
    try:
        tracing.check(config.tracing)
    except tracing.TracingUnavailable as exc:
        log.error(str(exc))
        return 2
    try:
        sock = bind(config.server.host, config.server.port)
    except BindError as exc:
        log.error(str(exc))
        return 1
    # Before the banner: a supervisor that stops the process as soon as it has said it
    # listens must see exit 0, not "killed by SIGTERM".
    signal.signal(signal.SIGTERM, shutdown.exit_cleanly)  # exit 0 after a graceful stop
    announce(startup_lines(config, port=sock.getsockname()[1]), config.server.log_format)
    options = uvicorn_options(config)
    try:
        if config.server.workers > 1:
            from uvicorn.supervisors import Multiprocess  # noqa: PLC0415

            # uvicorn starts workers as fresh processes: they need an import string, and
            # they get the already-validated config through the environment.
            os.environ[WORKER_ENV] = json.dumps(
                {"config": dataclasses.asdict(config), "log_level": log_level}
            )
            workers = uvicorn.Config(
                "proxy.server.serve:worker_app",
                factory=True,
                workers=config.server.workers,
                **options,
            )
            Multiprocess(workers, sockets=[sock]).run()
            return 0
        from proxy.server.app import create_app  # noqa: PLC0415

        server = uvicorn.Server(uvicorn.Config(create_app(config), **options))
        freeze_startup_objects()
        server.run(sockets=[sock])
        return 0 if server.started else 3  # 3: uvicorn's "startup failed"
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close()


def worker_app() -> Starlette:
    """The app factory each uvicorn worker calls (`streamfence --workers N`)."""
    from proxy.server.app import create_app  # noqa: PLC0415

    raw = json.loads(os.environ[WORKER_ENV])
    config = from_dict(raw["config"])
    logs.configure(raw["log_level"], config.server.log_format)
    app = create_app(config)
    freeze_startup_objects()
    return app


def freeze_startup_objects() -> None:
    """What the process holds after its imports lives as long as the process: moved out of
    the cyclic collector's sight, a full collection scans only what requests created. Under
    load (bench B5) a full collection otherwise paused the event loop for tens of
    milliseconds, and every request arriving meanwhile waited. (Rarer young collections saved
    little CPU and raised the peak memory of many streams, so the thresholds stay Python's:
    docs/history/benchmarks-2026-12.md, "the host, and garbage".)"""
    gc.collect()
    gc.freeze()
