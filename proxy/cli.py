"""The `streamfence` command: run the proxy, run the demo, or check a config file."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import ipaddress
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from proxy import __version__, egress, shutdown
from proxy.config import Config, ConfigError, from_dict, load

if TYPE_CHECKING:
    from starlette.applications import Starlette

COMMANDS = ("run", "demo", "check-config")
WORKER_ENV = "_STREAMFENCE_WORKER_CONFIG"  # not STREAMFENCE_*: that prefix is config keys


def _run_parser(prog: str = "streamfence") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="A local proxy that fences superseded LLM streaming attempts.",
        epilog="Commands: run (default), demo, check-config FILE.",
    )
    p.add_argument("--upstream", metavar="URL", help="forward every path to URL + path")
    p.add_argument("--config", metavar="FILE", help="a TOML file (see config.example.toml)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8787)")
    p.add_argument("--workers", type=int, help="uvicorn workers (needs the redis registry)")
    p.add_argument("--registry-url", metavar="URL", help="use the redis registry at URL")
    p.add_argument("--access-token", help="callers must send it as x-streamfence-token")
    p.add_argument("--log-format", choices=("json", "text"), help="request log format")
    p.add_argument("--log-level", default="info", help="debug, info, warning, error")
    p.add_argument("--version", action="version", version=f"streamfence {__version__}")
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {
        "upstream.url": args.upstream,
        "server.host": args.host,
        "server.port": args.port,
        "server.workers": args.workers,
        "server.access_token": args.access_token,
        "server.log_format": args.log_format,
    }
    if args.registry_url:
        overrides["registry.backend"] = "redis"
        overrides["registry.url"] = args.registry_url
    config = load(args.config, overrides=overrides)
    from proxy.upstream import ssl_context_for  # noqa: PLC0415 - imports httpx: not for --help

    # The environment's proxy URLs and CA certificates are checked now, not when the
    # server starts (a traceback) or at the first request.
    problems = []
    for check in (
        lambda: egress.plan(config, os.environ),
        lambda: ssl_context_for(config.server.ca_bundle, os.environ),
    ):
        try:
            check()
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError(problems)
    return config


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("streamfence")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    # One log line per request is on the hot path: skip what "%(message)s" never shows, the
    # caller's frame, thread and process (the logging HOWTO's "Optimization" section).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


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


def startup_lines(config: Config, environ: Mapping[str, str] | None = None) -> list[str]:
    s = config.server
    lines = [f"streamfence {__version__} listening on http://{s.host}:{s.port}"]
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
    if reg.backend == "redis":
        where = f" at {reg.url.split('@')[-1]} ({reg.on_unavailable} when unreachable)"
    lines.append(f"  registry: {reg.backend}{where}")
    if not _is_loopback(s.host) and not s.access_token:
        lines.append(
            f"WARNING: listening on {s.host}, which is not a loopback address, with no access "
            "token: anyone who can reach this port can use your upstream credentials' "
            "turns. Set [server] access_token or --access-token."
        )
    return lines


def serve(config: Config, log_level: str) -> int:
    import uvicorn  # noqa: PLC0415 - keep `--help` and check-config fast

    from proxy.app import create_app  # noqa: PLC0415

    setup_logging(log_level)
    for line in startup_lines(config):
        print(line, file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, shutdown.exit_cleanly)  # exit 0 after a graceful stop
    app: Any = None
    extra: dict[str, Any] = {}
    if config.server.workers > 1:
        # uvicorn starts workers as fresh processes: they need an import string, and
        # they get the already-validated config through the environment.
        os.environ[WORKER_ENV] = json.dumps(
            {"config": dataclasses.asdict(config), "log_level": log_level}
        )
        app, extra = "proxy.cli:worker_app", {"factory": True, "workers": config.server.workers}
    else:
        app = create_app(config)
        freeze_startup_objects()
    uvicorn.run(
        app,
        **extra,
        host=config.server.host,
        port=config.server.port,
        loop="uvloop",
        http="httptools",
        ws="websockets-sansio",
        ws_max_size=config.server.websocket_max_message_bytes + 1,  # the app says 1009 itself
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,  # the upstream's own date and server headers pass through
        date_header=False,
        # Later than the app's own deadline (proxy.shutdown), which ends streams cleanly.
        timeout_graceful_shutdown=shutdown.uvicorn_timeout(config.server.shutdown_grace),
    )
    return 0


def worker_app() -> Starlette:
    """The app factory each uvicorn worker calls (`streamfence --workers N`)."""
    from proxy.app import create_app  # noqa: PLC0415

    raw = json.loads(os.environ[WORKER_ENV])
    setup_logging(raw["log_level"])
    app = create_app(from_dict(raw["config"]))
    freeze_startup_objects()
    return app


def freeze_startup_objects() -> None:
    """What the process holds after its imports lives as long as the process: moved out of
    the cyclic collector's sight, a full collection scans only what requests created. In
    the benchmark (B5) a full collection otherwise paused the event loop for ~22 ms, and
    every request arriving meanwhile waited."""
    gc.collect()
    gc.freeze()


def check_config(argv: Sequence[str]) -> int:
    """Validate one file on its own (no environment, no flags): every problem, each with its
    key path, then exit 1; or what the file sets up, then exit 0."""
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(
            "usage: streamfence check-config FILE\n"
            "Checks FILE alone (environment and flags are not applied) and reports every\n"
            "problem with its key path, e.g. upstream[0].url.",
            file=sys.stderr,
        )
        return 2
    path = argv[0]
    try:
        config = load(path, env={})
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{path}: error: {problem}", file=sys.stderr)
        print(f"{path}: {len(exc.problems)} problem(s) found", file=sys.stderr)
        return 1
    print(f"{path}: ok")
    for line in startup_lines(config, environ={}):
        print(f"  {line.strip()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "run"
    if command == "check-config":
        return check_config(argv)
    if command == "demo":
        from proxy.demo import run_demo  # noqa: PLC0415

        return run_demo(argv)
    args = _run_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"streamfence: config error: {problem}", file=sys.stderr)
        return 2
    return serve(config, args.log_level)
