"""The rules a whole configuration must meet beyond each value's type and choices
(`proxy.config.load`): ranges, URLs, files that must exist, prefixes that must not collide, and
the rules across sections (several workers need a shared registry). Every problem names its
key path; all of them are reported at once.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from proxy.config import egress
from proxy.config.schema import Backend, Config

_EXAMPLE_URL = "https://api.openai.com"
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 token


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: from `low` (itself allowed or not) to `high`,
    always finite (an infinite timeout or size is a typo, and `math.ceil(inf)` a crash)."""

    low: float
    low_allowed: bool = True
    high: float = math.inf
    unit: str = ""  # what the number counts, for the message
    zero_means: str = ""  # what 0 does, where 0 is allowed and special

    def problem(self, value: float) -> str | None:
        notes = "; ".join(n for n in (self.unit, self.zero_means and f"0: {self.zero_means}") if n)
        notes = f" ({notes})" if notes else ""
        if not math.isfinite(value):
            return f"must be a finite number{notes}, not {value!r}"
        if self.high != math.inf and not self.low <= value <= self.high:
            return f"must be between {self.low:g} and {self.high:g}, not {value!r}"
        if value > self.low or (value == self.low and self.low_allowed):
            return None
        if not self.low_allowed:
            return f"must be more than {self.low:g}{notes}, not {value!r}"
        if self.low == 0:
            return f"must be 0 or more{notes}, not {value!r}"
        return f"must be at least {self.low:g}{notes}, not {value!r}"


_SECONDS_OR_NEVER = Range(0, unit="seconds", zero_means="waits for ever")
_SECONDS = Range(0, low_allowed=False, unit="seconds")
_BYTES = Range(1, unit="bytes")
# Every numeric setting, by its key path in the schema; a test checks that none is missing.
RANGES: dict[str, Range] = {
    "server.port": Range(0, high=65535),
    "server.workers": Range(1),
    "server.max_model_labels": Range(1),
    "server.max_body_bytes": _BYTES,
    "server.shutdown_grace": Range(0, unit="seconds", zero_means="ends streams at once"),
    "server.write_timeout": _SECONDS_OR_NEVER,
    "server.join_buffer_total_bytes": _BYTES,
    "server.websocket_max_message_bytes": _BYTES,
    "registry.lease_ttl": _SECONDS,
    "upstream.connect_timeout": _SECONDS,
    "upstream.idle_timeout": _SECONDS,
    "upstream.max_event_bytes": _BYTES,
    # 0: no running generation is healthy, so an identical retry always replaces it.
    "upstream.healthy_within": Range(
        0, unit="seconds", zero_means="every stream counts as stalled"
    ),
    "upstream.replay_window": Range(0, unit="seconds", zero_means="never replays"),
    "upstream.join_buffer_bytes": _BYTES,
}


def _ranges(section: str, where: str, values: object) -> list[str]:
    problems = []
    for path, allowed in RANGES.items():
        owner, _, key = path.partition(".")
        if owner != section:
            continue
        found = allowed.problem(getattr(values, key))
        if found is not None:
            problems.append(f"{where}.{key}: {found}")
    return problems


def problems(config: Config) -> list[str]:
    """Every rule the whole configuration breaks, by key path."""
    problems: list[str] = []
    problems += _ranges("server", "server", config.server)
    problems += _ranges("registry", "registry", config.registry)
    for i, up in enumerate(config.upstream):
        problems += _ranges("upstream", f"upstream[{i}]", up)
    if config.server.workers > 1 and config.registry.backend == Backend.MEMORY:
        problems.append(
            "server.workers: several workers need a shared registry; the in-memory one lives "
            "in one process, so a retry landing on another worker would fence nothing. "
            'Set [registry] backend = "redis"'
        )
    if config.registry.backend == Backend.REDIS and urlsplit(config.registry.url).scheme not in (
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
    return problems
