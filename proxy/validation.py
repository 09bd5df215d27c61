"""The rules a whole configuration must meet beyond each value's type and choices
(`proxy.config`): ranges, URLs, files that must exist, prefixes that must not collide, and
the rules across sections (several workers need a shared registry). Every problem names its
key path; all of them are reported at once.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from proxy import egress

if TYPE_CHECKING:
    from proxy.config import Config

_EXAMPLE_URL = "https://api.openai.com"
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 token


def problems(config: Config) -> list[str]:
    """Every rule the whole configuration breaks, by key path."""
    problems: list[str] = []
    if not 0 <= config.server.port <= 65535:
        problems.append("server.port: must be between 0 and 65535")
    if config.server.workers < 1:
        problems.append("server.workers: must be at least 1")
    if config.server.workers > 1 and config.registry.backend == "memory":
        problems.append(
            "server.workers: several workers need a shared registry; the in-memory one lives "
            "in one process, so a retry landing on another worker would fence nothing. "
            'Set [registry] backend = "redis"'
        )
    for key in ("write_timeout", "shutdown_grace"):
        if getattr(config.server, key) < 0:
            problems.append(f"server.{key}: must not be negative")
    if config.server.max_body_bytes < 1:
        problems.append("server.max_body_bytes: must be positive")
    if config.server.websocket_max_message_bytes < 1:
        problems.append("server.websocket_max_message_bytes: must be positive")
    if config.registry.lease_ttl <= 0:
        problems.append("registry.lease_ttl: must be positive (seconds)")
    if config.registry.backend == "redis" and urlsplit(config.registry.url).scheme not in (
        "redis",
        "rediss",
        "unix",
        "redis+cluster",
        "rediss+cluster",
    ):
        problems.append(
            "registry.url: must be a redis://, rediss:// or unix:// URL "
            "(redis+cluster:// or rediss+cluster:// for a Redis Cluster)"
        )
    traces = urlsplit(config.tracing.endpoint)
    if config.tracing.endpoint and (traces.scheme not in ("http", "https") or not traces.netloc):
        problems.append("tracing.endpoint: must be an http:// or https:// URL")
    if not config.turns.header.strip():
        problems.append("turns.header: must not be empty")
    elif not _HEADER_NAME.fullmatch(config.turns.header):
        # Any other name would never match a request header (or fail to encode at startup).
        problems.append(f"turns.header: must be an HTTP header name, not {config.turns.header!r}")
    if not config.upstream:
        problems.append(
            "upstream: at least one upstream is needed (required: --upstream URL, "
            "STREAMFENCE_UPSTREAM_URL, or an [[upstream]] table with a url)"
        )
    ca = config.server.ca_bundle
    if ca and not os.path.exists(ca):
        problems.append(f"server.ca_bundle: no such file or directory: {ca!r}")
    problems += egress.problems(config)
    seen: set[str] = set()
    for i, up in enumerate(config.upstream):
        where = f"upstream[{i}]"
        parts = urlsplit(up.url)
        if not up.url:
            problems.append(f"{where}.url: required: the provider's base URL, e.g. {_EXAMPLE_URL}")
        elif parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(f"{where}.url: must be an http:// or https:// URL, not {up.url!r}")
        if not up.prefix.startswith("/"):
            problems.append(f"{where}.prefix: must start with '/', not {up.prefix!r}")
        if up.prefix.startswith("/_streamfence"):
            problems.append(f"{where}.prefix: /_streamfence/ is reserved for the proxy itself")
        # "/a" and "/a/" route the same paths (the router strips trailing slashes).
        same = up.prefix.rstrip("/") or "/"
        if same in seen:
            problems.append(f"{where}.prefix: {up.prefix!r} is used by another upstream")
        seen.add(same)
        for key in ("connect_timeout", "idle_timeout"):
            if getattr(up, key) <= 0:
                problems.append(f"{where}.{key}: must be positive")
    return problems
