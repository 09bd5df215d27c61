"""The configuration schema of CONTRACT section 7: every section, every key and its default.

Pure types: loading (TOML, environment, flags, each value's type and choices) is
`proxy.config.load`, the rules over several values `proxy.config.validation`.
`config.example.toml` documents each key and a test keeps the two in sync.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

# The settings with fixed choices. Members in the order an error message lists them
# ("must be one of auto, json, text, not 'xml'"); compared with their members, never with
# a spelled-out string.


class LogFormat(StrEnum):
    """[server] log_format: the process's log lines (proxy.ops.logs)."""

    AUTO = "auto"  # text on a terminal, JSON otherwise (proxy.ops.logs.resolve_format)
    JSON = "json"
    TEXT = "text"


class HttpTransport(StrEnum):
    """[server] http_transport: the upstream HTTP client's transport."""

    HTTPX = "httpx"  # httpx's own (httpcore + h11), kept as a fallback
    FAST = "fast"  # proxy/upstream/transport.py: HTTP/1.1 on the event loop with httptools


class Backend(StrEnum):
    """[registry] backend: where turns are claimed and fenced."""

    MEMORY = "memory"  # in the process: one process only
    REDIS = "redis"  # shared by every process on the Redis (or Redis Cluster)


class OnUnavailable(StrEnum):
    """[registry] on_unavailable: a keyed request while the registry does not answer."""

    FAIL_OPEN = "fail_open"  # forwarded unfenced
    FAIL_CLOSED = "fail_closed"  # refused with 503


class TracingMode(StrEnum):
    """[tracing] enabled: whether OpenTelemetry traces are exported (proxy.ops.tracing)."""

    AUTO = "auto"  # on when the standard OTEL_* variables ask for it
    ON = "on"
    OFF = "off"


class OnRetry(StrEnum):
    """What a repeated request of a running turn does (CONTRACT section 3): follow the
    running generation while it is healthy, always, or never."""

    ADAPTIVE = "adaptive"
    SUPERSEDE = "supersede"
    JOIN = "join"


class EventIds(StrEnum):
    """[[upstream]] event_ids: `id:` lines on relayed SSE events, for Last-Event-ID resumes."""

    AUTO = "auto"  # on generic SSE paths only (LLM SDKs never resume)
    ALWAYS = "always"
    NEVER = "never"


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
    log_format: LogFormat = LogFormat.AUTO
    workers: int = 1
    # The upstream HTTP client's transport: "fast" (proxy/upstream/transport.py, HTTP/1.1 on
    # the event loop with httptools) or "httpx" (httpx's own, httpcore + h11: several times the
    # CPU per event, kept as a fallback; docs/performance.md).
    http_transport: HttpTransport = HttpTransport.FAST
    # All generation buffers of the process together (what followers read).
    join_buffer_total_bytes: int = 256 * 1024 * 1024
    # Models that get a metric label of their own, per upstream (the first ones seen); the
    # others are counted as "other", so that odd request bodies cannot blow up the metrics.
    max_model_labels: int = 100
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
    backend: Backend = Backend.MEMORY
    url: str = "redis://127.0.0.1:6379/0"
    on_unavailable: OnUnavailable = OnUnavailable.FAIL_OPEN
    lease_ttl: float = 3600.0
    # Publish followable generations to Redis, so that an identical request on another
    # process follows them (proxy/turn/remote.py) instead of starting its own.
    follow_across: bool = True


@dataclass(frozen=True)
class TracingConfig:
    # OpenTelemetry traces (proxy/ops/tracing.py, the `streamfence[otel]` extra). "auto": on
    # when the standard OTEL_* variables ask for it; "on" / "off" decide regardless.
    enabled: TracingMode = TracingMode.AUTO
    # The OTLP/HTTP traces endpoint; "" leaves it to OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT.
    endpoint: str = ""


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
    event_ids: EventIds = EventIds.AUTO
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


def defaults_as_dict() -> dict[str, Any]:
    """Every key and its default, for the example-file sync test and `check-config`."""
    return {
        "server": dataclasses.asdict(ServerConfig()),
        "turns": dataclasses.asdict(TurnsConfig()),
        "registry": dataclasses.asdict(RegistryConfig()),
        "upstream": dataclasses.asdict(UpstreamConfig()),
        "tracing": dataclasses.asdict(TracingConfig()),
    }
