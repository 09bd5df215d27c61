"""The `streamfence` command: serve (the default), demo, check-config, help.

argparse subcommands; every mistake on the command line is one line on stderr and exit 2,
every `--help` exit 0. Running the proxy itself is proxy/server/serve.py.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from proxy import __version__
from proxy.config.load import ConfigError, load
from proxy.config.schema import Backend, Config, LogFormat

EXAMPLE_URL = "https://github.com/streamfence/streamfence/blob/main/config.example.toml"
UPSTREAM_ENV = "STREAMFENCE_UPSTREAM_"  # an upstream set in the environment
COMMANDS = ("serve", "run", "demo", "check-config", "help")  # run: the old name of serve
LOG_LEVELS = ("debug", "info", "warning", "error")
# The flag each config key can come from, for error messages that name what the user typed.
FLAGS = {
    "upstream.url": "--upstream",
    "server.host": "--host",
    "server.port": "--port",
    "server.workers": "--workers",
    "server.access_token": "--access-token",
    "server.log_format": "--log-format",
    "registry.url": "--registry-url",
    "registry.backend": "--registry-url",
}


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block plus the error: the message is what matters.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _serve_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--upstream", metavar="URL", help="forward every path to URL + path")
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"a TOML file; every key is described in config.example.toml ({EXAMPLE_URL})",
    )
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8787; 0 picks a free one)")
    p.add_argument("--workers", type=int, help="uvicorn workers (needs the redis registry)")
    p.add_argument("--registry-url", metavar="URL", help="use the redis registry at URL")
    p.add_argument("--access-token", help="callers must send it as x-streamfence-token")
    p.add_argument(
        "--log-format",
        choices=[f.value for f in LogFormat],  # plain strings: argparse shows their repr
        help="log format (default auto: text on a terminal, JSON otherwise)",
    )
    p.add_argument(
        "--log-level", type=str.lower, choices=LOG_LEVELS, default="info", help="default info"
    )


TOP_EPILOG = """commands:
  serve          run the proxy (the default: `streamfence --upstream URL` serves)
  demo           see the fence live, with no network and no key
  check-config   validate a config file
  help           show help for a command

Options of a command: streamfence COMMAND --help."""


def build_parser() -> Parser:
    top = Parser(
        prog="streamfence",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=(
            "\n  streamfence [serve] [--upstream URL | --config FILE] [options]"
            "\n  streamfence demo [--pace SECONDS] [--no-color]"
            "\n  streamfence check-config FILE"
            "\n  streamfence help [COMMAND]"
        ),
        description="A local proxy that fences superseded LLM streaming attempts: "
        "one writer per turn.",
        epilog=TOP_EPILOG,
    )
    top.add_argument("--version", action="version", version=f"streamfence {__version__}")
    sub = top.add_subparsers(dest="command", help=argparse.SUPPRESS)  # listed in the epilog
    serve = sub.add_parser(
        "serve",
        prog="streamfence serve",
        aliases=["run"],
        help="run the proxy (the default command)",
        description="Run the proxy. Settings: flags beat STREAMFENCE_* environment "
        "variables beat the --config file.",
    )
    _serve_options(serve)
    serve.set_defaults(func=_serve)

    demo = sub.add_parser(
        "demo",
        prog="streamfence demo",
        help="see the fence live, with no network and no key",
        description="A scripted provider and the proxy on 127.0.0.1: an agent retries a "
        "stalled stream, once straight to the provider and once through streamfence.",
    )
    demo.add_argument(
        "--pace", type=_pace, default=0.12, help="seconds between tokens (default 0.12)"
    )
    demo.add_argument("--no-color", action="store_true", help="no colours (also NO_COLOR=1)")
    demo.set_defaults(func=_demo)

    check = sub.add_parser(
        "check-config",
        prog="streamfence check-config",
        help="validate a config file",
        description="Check FILE alone (environment and flags are not applied) and report "
        "every problem with its key path, e.g. upstream[0].url.",
    )
    check.add_argument("file", metavar="FILE")
    check.set_defaults(func=_check_config)

    help_ = sub.add_parser(
        "help", prog="streamfence help", help="show help for a command", description="Show help."
    )
    help_.add_argument("topic", metavar="COMMAND", nargs="?", choices=COMMANDS)
    help_.set_defaults(func=lambda args: _help(top, sub.choices, args.topic))
    return top


def _pace(text: str) -> float:
    """--pace: a positive, finite number of seconds. At 0 the provider's stall is no stall,
    and the demo would "show" a fence that could not happen."""
    try:
        pace = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, not {text!r}") from None
    if not (math.isfinite(pace) and pace > 0):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {text!r}")
    return pace


# `streamfence` alone, with no upstream in the environment either: what a first-time user
# needs is how to start, not a config error about upstreams.
FIRST_STEPS = """\
streamfence: a local proxy for LLM agents: one writer per turn. To start it:
  streamfence --upstream https://api.openai.com
then point your client's base_url at http://127.0.0.1:8787/v1. A config file
instead (every key is in config.example.toml): streamfence --config FILE
See the fence work first, with no network and no key: streamfence demo
Every command and option: streamfence --help"""


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list:
        if not any(name.startswith(UPSTREAM_ENV) for name in os.environ):
            print(FIRST_STEPS, file=sys.stderr)
            return 2
        args_list = ["serve"]  # the Docker image's way: STREAMFENCE_UPSTREAM_URL and no flags
    parser = build_parser()
    first = args_list[0]
    if first not in COMMANDS and not first.startswith("-"):
        print(
            f"streamfence: error: unknown command {first!r} (commands: serve, demo, "
            "check-config, help; see streamfence --help)",
            file=sys.stderr,
        )
        return 2
    if first not in COMMANDS and first not in ("-h", "--help", "--version"):
        args_list.insert(0, "serve")  # `streamfence --upstream URL`
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help, --version, a usage error: argparse has said it
        return exc.code if isinstance(exc.code, int) else 2
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


def _help(top: Parser, commands: dict[str, Any], topic: str | None) -> int:
    parser = top if topic is None else commands[topic]
    parser.print_help()
    return 0


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
        overrides["registry.backend"] = Backend.REDIS
        overrides["registry.url"] = args.registry_url
    config = load(args.config, overrides=overrides, flags=FLAGS)
    from proxy.config import egress  # noqa: PLC0415 - keep `--help` fast
    from proxy.upstream.client import ssl_context_for  # noqa: PLC0415 - imports httpx: not for --help

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


def _serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        where = f"{exc.where}: " if exc.where else ""
        for problem in exc.problems:
            print(f"streamfence: config error: {where}{problem}", file=sys.stderr)
        return 2
    from proxy.server.serve import serve  # noqa: PLC0415 - keep `--help` and check-config fast

    return serve(config, args.log_level)


def _demo(args: argparse.Namespace) -> int:
    from proxy.demo import run_demo  # noqa: PLC0415

    return run_demo(args.pace, no_color=args.no_color)


def _check_config(args: argparse.Namespace) -> int:
    """Validate one file on its own (no environment, no flags): every problem, each with its
    key path, then exit 2 (a config error, as from every command); or what the file sets
    up, then exit 0."""
    from proxy.server.serve import startup_lines  # noqa: PLC0415

    path = args.file
    try:
        config = load(path, env={})
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{exc.where or path}: error: {problem}", file=sys.stderr)
        if len(exc.problems) > 1:
            print(f"{path}: {len(exc.problems)} problems found", file=sys.stderr)
        return 2
    print(f"{path}: ok")
    for line in startup_lines(config, verb="would listen on", environ={}):
        print(f"  {line.strip()}")
    return 0
