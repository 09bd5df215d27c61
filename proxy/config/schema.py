"""The configuration schema of CONTRACT section 7: TOML file, then environment, then flags.

Every key has a default here; `config.example.toml` documents each one and a test keeps the
two in sync. Errors name the key path (`upstream[1].url: ...`) and are all reported at once.
Each value is checked for its type and choices here, the rules over several values in
`proxy.config.validation`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, get_type_hints

from proxy.config import validation
from proxy.wire.dialects import DIALECTS

ENV_PREFIX = "STREAMFENCE_"
MAX_UPSTREAMS = 256  # STREAMFENCE_UPSTREAM_<index>_*: a typo'd huge index must not allocate


class ConfigError(Exception):
    """Every problem found, each "key path: what is wrong". `where` is set when the problem
    is the file itself (unreadable, not TOML): the file, and the line and column when known
    (`config.toml:3:6`), which the message then does not repeat."""

    def __init__(self, problems: list[str], where: str = "") -> None:
        super().__init__("; ".join(f"{where}: {p}" if where else p for p in problems))
        self.problems = problems
        self.where = where


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8787
    access_token: str = ""
    max_body_bytes: int = 32 * 1024 * 1024
    # Below the default stop timeouts of Docker (10 s) and Kubernetes (30 s) with uvicorn's
    # margin on top (shutdown.UVICORN_MARGIN): 5 + 3 < 10, so `docker stop` never kills it.
    shutdown_grace: float = 5.0
    # A client that keeps one write blocked this long (not reading) is dropped and its
    # upstream closed; 0 waits for ever. Flow control already bounds what is buffered.
    write_timeout: float = 60.0
    # "auto": text on a terminal, JSON otherwise (proxy.ops.logs.resolve_format).
    log_format: str = "auto"
    workers: int = 1
    # The upstream HTTP client's transport: "fast" (proxy/upstream/transport.py, HTTP/1.1 on
    # the event loop with httptools) or "httpx" (httpx's own, httpcore + h11: ~3x the CPU per event,
    # kept as a fallback; docs/benchmarks.md).
    http_transport: str = "fast"
    # All generation buffers of the process together (what followers read).
    join_buffer_total_bytes: int = 256 * 1024 * 1024
    # WebSocket mode: a client message over this closes the socket with 1009.
    websocket_max_message_bytes: int = 32 * 1024 * 1024
    # The forward proxy to the upstreams: "" from HTTPS_PROXY/HTTP_PROXY/ALL_PROXY/NO_PROXY,
    # "none" for direct connections, or an http:// URL (proxy/config/egress.py).
    egress_proxy: str = ""
    # CA certificates to verify upstreams with (a PEM file or a c_rehash'd directory); ""
    # for SSL_CERT_FILE / SSL_CERT_DIR, else the system's.
    ca_bundle: str = ""


@dataclass(frozen=True)
class TurnsConfig:
    header: str = "X-Turn-Id"
    # The same, as a query parameter, for clients that cannot set headers (a browser's
    # EventSource); removed before forwarding. "" turns it off.
    query_param: str = "streamfence_turn"
    ignore_fields: tuple[str, ...] = ("stream", "stream_options", "timeout")


@dataclass(frozen=True)
class RegistryConfig:
    backend: str = "memory"
    url: str = "redis://127.0.0.1:6379/0"
    on_unavailable: str = "fail_open"
    lease_ttl: float = 3600.0
    # Publish followable generations to Redis, so that an identical request on another
    # process follows them (proxy/turn/remote.py) instead of starting its own.
    follow_across: bool = True


@dataclass(frozen=True)
class TracingConfig:
    # OpenTelemetry traces (proxy/ops/tracing.py, the `streamfence[otel]` extra). "auto": on
    # when the standard OTEL_* variables ask for it; "on" / "off" decide regardless.
    enabled: str = "auto"
    # The OTLP/HTTP traces endpoint; "" leaves it to OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT.
    endpoint: str = ""


class OnRetry(StrEnum):
    """What a repeated request of a running turn does (CONTRACT section 3): follow the
    running generation while it is healthy, always, or never."""

    ADAPTIVE = "adaptive"
    SUPERSEDE = "supersede"
    JOIN = "join"


@dataclass(frozen=True)
class UpstreamConfig:
    url: str = ""
    name: str = "default"
    prefix: str = "/"
    dialect: str = "auto"
    fingerprint: bool = True
    on_retry: OnRetry = OnRetry.ADAPTIVE
    connect_timeout: float = 10.0
    idle_timeout: float = 600.0
    max_event_bytes: int = 16 * 1024 * 1024
    # on_retry = adaptive: follow a running generation only if it showed life this recently.
    healthy_within: float = 10.0
    # `id:` lines on relayed SSE events, for Last-Event-ID resumes: "auto" adds them on
    # generic SSE paths only (LLM SDKs never resume), "always", or "never".
    event_ids: str = "auto"
    replay_window: float = 0.0  # seconds a finished stream stays replayable; 0: never
    replay_fingerprints: bool = False  # replay for fingerprint keys too, not only X-Turn-Id
    join_buffer_bytes: int = 8 * 1024 * 1024  # per generation; over it, nobody may follow
    egress_proxy: str = ""  # "" as [server] egress_proxy, "none" direct, or an http:// URL


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    turns: TurnsConfig = field(default_factory=TurnsConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    upstream: tuple[UpstreamConfig, ...] = ()
    tracing: TracingConfig = field(default_factory=TracingConfig)


_CHOICES: dict[str, tuple[str, ...]] = {
    "server.log_format": ("auto", "json", "text"),
    "server.http_transport": ("httpx", "fast"),
    "registry.backend": ("memory", "redis"),
    "registry.on_unavailable": ("fail_open", "fail_closed"),
    "tracing.enabled": ("auto", "on", "off"),
    "upstream.dialect": ("auto", *DIALECTS),
    "upstream.event_ids": ("auto", "always", "never"),
}


def load(
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    flags: Mapping[str, str] | None = None,
) -> Config:
    """Build a Config: file, then `STREAMFENCE_*` environment, then `overrides` (CLI flags).

    `overrides` uses dotted key paths ("server.port"), plus "upstream.url" as a shorthand
    for one upstream at prefix "/". `flags` names the flag each override came from
    ({"server.port": "--port"}): a problem with a value says where the user set it, the
    environment variable or the flag, after its key path.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_toml(path)
    env = os.environ if env is None else env
    from_env, env_names = _from_env(env)
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    origin = {_problem_path(k): name for k, name in env_names.items()}
    origin.update({_problem_path(k): flags[k] for k in given if flags and k in flags})
    _apply(data, from_env)
    _apply(data, given)
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError([_with_origin(p, origin) for p in exc.problems]) from None


def _problem_path(dotted: str) -> str:
    """The key path problems are reported with: upstream.0.url -> upstream[0].url."""
    parts = dotted.split(".")
    if parts[0] == "upstream":
        if len(parts) == 2:  # the single-upstream shorthand sets the first one
            parts = ["upstream", "0", parts[1]]
        return f"upstream[{parts[1]}].{'.'.join(parts[2:])}"
    return dotted


def _with_origin(problem: str, origin: Mapping[str, str]) -> str:
    key = problem.split(":", 1)[0]
    where = origin.get(key)
    return f"{problem} (from {where})" if where else problem


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror}"], where=path) from exc
    except tomllib.TOMLDecodeError as exc:
        # tomllib ends its message with "(at line 3, column 6)": moved to the front, as
        # compilers name a place (file:line:column), so that the file is named once.
        message, at = str(exc), _TOML_PLACE.search(str(exc))
        if at is None:
            raise ConfigError([f"not valid TOML: {message}"], where=path) from exc
        where = f"{path}:{at['line']}:{at['column']}"
        raise ConfigError([f"not valid TOML: {message[: at.start()]}"], where=where) from exc


_TOML_PLACE = re.compile(r" \(at line (?P<line>\d+), column (?P<column>\d+)\)$")


def _from_env(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings in `env`, by dotted key path, and the variable each came from."""
    out: dict[str, Any] = {}
    names: dict[str, str] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("_", 1)
        if len(parts) != 2:
            continue
        section, rest = parts
        if section == "upstream":
            index, _, key = rest.partition("_")
            dotted = f"upstream.{index}.{key}" if index.isdigit() else f"upstream.{rest}"
        elif section in ("server", "turns", "registry", "tracing"):
            dotted = f"{section}.{rest}"
        else:
            continue
        out[dotted] = value
        names[dotted] = name
    return out, names


def _apply(data: dict[str, Any], flat: Mapping[str, Any]) -> None:
    for dotted, value in flat.items():
        if value is None:
            continue
        parts = dotted.split(".")
        if parts[0] == "upstream":
            upstreams = data.setdefault("upstream", [])
            if not isinstance(upstreams, list):
                continue  # a file's [upstream] that should be [[upstream]]: from_dict says so
            if len(parts) == 2:  # the single-upstream shorthand
                if not upstreams:
                    upstreams.append({})
                if isinstance(upstreams[0], dict):
                    upstreams[0][parts[1]] = value
                continue
            index = int(parts[1])
            if index >= MAX_UPSTREAMS:
                raise ConfigError([f"upstream[{index}]: at most {MAX_UPSTREAMS} upstreams"])
            while len(upstreams) <= index:
                upstreams.append({})
            if isinstance(upstreams[index], dict):
                upstreams[index][parts[2]] = value
            continue
        section = data.setdefault(parts[0], {})
        if isinstance(section, dict):  # else from_dict reports "must be a table"
            section[parts[1]] = value


def from_dict(data: Mapping[str, Any]) -> Config:
    problems: list[str] = []
    sections = [f.name for f in dataclasses.fields(Config)]
    unknown = set(data) - set(sections)
    problems += [f"{key}: unknown section{_did_you_mean(key, sections)}" for key in sorted(unknown)]
    server = _build(ServerConfig, data.get("server", {}), "server", problems)
    turns = _build(TurnsConfig, data.get("turns", {}), "turns", problems)
    registry = _build(RegistryConfig, data.get("registry", {}), "registry", problems)
    tracing = _build(TracingConfig, data.get("tracing", {}), "tracing", problems)
    raw_upstreams = data.get("upstream", [])
    if not isinstance(raw_upstreams, list):
        problems.append("upstream: must be an array of tables ([[upstream]])")
        raw_upstreams = []
    upstreams = tuple(
        _build(UpstreamConfig, raw, f"upstream[{i}]", problems)
        for i, raw in enumerate(raw_upstreams)
    )
    config = Config(
        server=server, turns=turns, registry=registry, upstream=upstreams, tracing=tracing
    )
    problems += validation.problems(config)
    if problems:
        raise ConfigError(problems)
    return config


def _build(cls: type[Any], raw: Any, path: str, problems: list[str]) -> Any:
    if not isinstance(raw, Mapping):
        problems.append(f"{path}: must be a table")
        return cls()
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in hints:
            problems.append(f"{path}.{key}: unknown key{_did_you_mean(key, hints)}")
            continue
        try:
            values[key] = _coerce(value, hints[key])
        except (TypeError, ValueError) as exc:
            problems.append(f"{path}.{key}: {exc}")
    section = path.split("[")[0]
    for key, value in values.items():
        choices = _CHOICES.get(f"{section}.{key}")
        if choices and value not in choices:
            problems.append(f"{path}.{key}: must be one of {', '.join(choices)}, not {value!r}")
    return cls(**values)


def _did_you_mean(key: str, known: Iterable[str]) -> str:
    """The known key nearest to a mistyped one (heathy_within: healthy_within), if any is
    near enough to be the one meant."""
    close = difflib.get_close_matches(str(key).lower(), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _coerce(value: Any, hint: Any) -> Any:
    # Environment and flags give strings; TOML gives typed values. Accept both.
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in (
            "1",
            "true",
            "yes",
            "on",
            "0",
            "false",
            "no",
            "off",
        ):
            return value.lower() in ("1", "true", "yes", "on")
        raise TypeError(f"must be true or false, not {value!r}")
    if hint is int or hint is float:
        if isinstance(value, bool):
            raise TypeError(f"must be a number, not {value!r}")
        # int(8787.9) would quietly drop the fraction (and int(inf) raise OverflowError).
        if hint is int and isinstance(value, float) and not value.is_integer():
            raise TypeError(f"must be a whole number, not {value!r}")
        try:
            number = hint(value)
        except (TypeError, ValueError):
            raise TypeError(f"must be a number, not {value!r}") from None
        if number != number:  # NaN passes every range check below
            raise TypeError(f"must be a number, not {value!r}")
        return number
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        if not isinstance(value, str):
            raise TypeError(f"must be a string, not {value!r}")
        try:
            return hint(value)
        except ValueError:
            raise TypeError(f"must be one of {', '.join(hint)}, not {value!r}") from None
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"must be a string, not {value!r}")
        return value
    # tuple[str, ...]
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"must be a list of strings, not {value!r}")


def defaults_as_dict() -> dict[str, Any]:
    """Every key and its default, for the example-file sync test and `check-config`."""
    return {
        "server": dataclasses.asdict(ServerConfig()),
        "turns": dataclasses.asdict(TurnsConfig()),
        "registry": dataclasses.asdict(RegistryConfig()),
        "upstream": dataclasses.asdict(UpstreamConfig()),
        "tracing": dataclasses.asdict(TracingConfig()),
    }
