"""Loading the configuration of CONTRACT section 7: TOML file, then environment, then flags.

Every key has a default in `proxy.config.schema`. Errors name the key path
(`upstream[1].url: ...`) and are all reported at once. Each value is checked for its type and
choices here, the rules over several values in `proxy.config.validation`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any, get_type_hints

from proxy.config import validation
from proxy.config.schema import (
    Config,
    RegistryConfig,
    ServerConfig,
    TracingConfig,
    TurnsConfig,
    UpstreamConfig,
)
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


# The choices of a setting that is a string, not a StrEnum of the schema (those are checked
# by `_coerce`, with the same message): the dialects are proxy.wire's to name.
_CHOICES: dict[str, tuple[str, ...]] = {
    "upstream.dialect": ("auto", *DIALECTS),
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
