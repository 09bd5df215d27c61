"""proxy.config.load: defaults, the TOML file, STREAMFENCE_* environment and flags, in that order
of precedence, and bad values reported with their key path (CONTRACT section 7).

The example file and `check-config` have their own tests in tests/config/test_example_file.py."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, get_type_hints

import pytest

from proxy.config.load import ConfigError, from_dict, load
from proxy.config.schema import (
    Config,
    RegistryConfig,
    ServerConfig,
    TracingConfig,
    TurnsConfig,
    UpstreamConfig,
)
from proxy.config.validation import RANGES

URL = {"upstream.url": "http://127.0.0.1:9"}

FILE = """
[server]
host = "127.0.0.2"
port = 9000

[turns]
header = "X-My-Turn"
ignore_fields = ["stream", "seed"]

[registry]
backend = "redis"
url = "redis://127.0.0.1:6390/1"
on_unavailable = "fail_closed"

[[upstream]]
name = "openai"
prefix = "/openai"
url = "https://api.openai.test"
dialect = "openai-chat"

[[upstream]]
name = "anthropic"
prefix = "/anthropic/"
url = "https://api.anthropic.test/base"
dialect = "auto"
fingerprint = false
connect_timeout = 2.5

[[upstream]]
name = "rest"
url = "http://127.0.0.1:8080"
"""


@pytest.fixture
def toml(tmp_path: Path) -> Path:
    path = tmp_path / "streamfence.toml"
    path.write_text(FILE)
    return path


def problems_of(**kwargs: Any) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(**kwargs)
    assert str(caught.value) == "; ".join(caught.value.problems)
    return caught.value.problems


def test_defaults() -> None:
    config = load(env={}, overrides=URL)
    assert config.server == ServerConfig()
    assert (config.server.host, config.server.port, config.server.workers) == ("127.0.0.1", 8787, 1)
    assert config.turns == TurnsConfig()
    assert config.turns.header == "X-Turn-Id"
    assert config.turns.ignore_fields == ("stream", "stream_options", "timeout")
    assert config.registry == RegistryConfig()
    assert (config.registry.backend, config.registry.on_unavailable) == ("memory", "fail_open")
    (up,) = config.upstream
    assert up == UpstreamConfig(url="http://127.0.0.1:9")
    assert (up.prefix, up.dialect, up.fingerprint, up.on_retry) == ("/", "auto", True, "adaptive")


def test_upstream_is_required() -> None:
    assert any(p.startswith("upstream: at least one") for p in problems_of(env={}))


def test_file_with_several_upstreams(toml: Path) -> None:
    config = load(str(toml), env={})
    assert (config.server.host, config.server.port) == ("127.0.0.2", 9000)
    assert config.turns.header == "X-My-Turn"
    assert config.turns.ignore_fields == ("stream", "seed")
    assert config.registry == RegistryConfig(
        backend="redis", url="redis://127.0.0.1:6390/1", on_unavailable="fail_closed"
    )
    openai, anthropic, rest = config.upstream
    assert (openai.name, openai.prefix, openai.dialect) == ("openai", "/openai", "openai-chat")
    assert (anthropic.prefix, anthropic.url) == ("/anthropic/", "https://api.anthropic.test/base")
    assert (anthropic.fingerprint, anthropic.connect_timeout) == (False, 2.5)
    assert (rest.name, rest.prefix, rest.fingerprint) == ("rest", "/", True)


def test_environment_overrides_the_file(toml: Path) -> None:
    env = {
        "STREAMFENCE_SERVER_PORT": "9100",
        "STREAMFENCE_SERVER_ACCESS_TOKEN": "tok",
        "STREAMFENCE_TURNS_IGNORE_FIELDS": "stream, timeout,",
        "STREAMFENCE_REGISTRY_URL": "redis://127.0.0.1:6391/0",
        "STREAMFENCE_REGISTRY_ON_UNAVAILABLE": "fail_open",
        "STREAMFENCE_UPSTREAM_1_FINGERPRINT": "yes",
        "STREAMFENCE_UPSTREAM_2_CONNECT_TIMEOUT": "4",
        "STREAMFENCE_UPSTREAM_0_MAX_EVENT_BYTES": "1024",
        "OTHER_SERVER_PORT": "1",  # not ours
        "STREAMFENCE_NOTHING": "x",  # no key path: ignored
    }
    config = load(str(toml), env=env)
    assert config.server.port == 9100
    assert config.server.host == "127.0.0.2"  # untouched keys keep the file's value
    assert config.server.access_token == "tok"
    assert config.turns.ignore_fields == ("stream", "timeout")
    assert config.registry.url == "redis://127.0.0.1:6391/0"
    assert config.registry.on_unavailable == "fail_open"
    assert config.registry.backend == "redis"
    openai, anthropic, rest = config.upstream
    assert openai.max_event_bytes == 1024 and openai.dialect == "openai-chat"
    assert anthropic.fingerprint is True
    assert rest.connect_timeout == 4.0


def test_environment_alone_is_a_working_setup() -> None:
    env = {"STREAMFENCE_UPSTREAM_URL": "http://127.0.0.1:9", "STREAMFENCE_SERVER_PORT": "0"}
    config = load(env=env)
    assert config.server.port == 0
    assert config.upstream == (UpstreamConfig(url="http://127.0.0.1:9"),)


def test_single_upstream_shorthand_keys_from_the_environment() -> None:
    env = {
        "STREAMFENCE_UPSTREAM_URL": "http://127.0.0.1:9",
        "STREAMFENCE_UPSTREAM_CONNECT_TIMEOUT": "3",
        "STREAMFENCE_UPSTREAM_DIALECT": "anthropic",
    }
    (up,) = load(env=env).upstream
    assert (up.connect_timeout, up.dialect) == (3.0, "anthropic")


def test_flags_beat_the_environment_and_the_file(toml: Path) -> None:
    env = {"STREAMFENCE_SERVER_PORT": "9100", "STREAMFENCE_SERVER_HOST": "127.0.0.3"}
    overrides = {
        "server.port": 9200,
        "server.host": None,  # a flag that was not given changes nothing
        "upstream.url": "http://127.0.0.1:7",
    }
    config = load(str(toml), env=env, overrides=overrides)
    assert config.server.port == 9200
    assert config.server.host == "127.0.0.3"
    assert config.upstream[0].url == "http://127.0.0.1:7"  # --upstream: the first upstream
    assert config.upstream[0].prefix == "/openai"


def test_the_real_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMFENCE_UPSTREAM_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("STREAMFENCE_SERVER_PORT", "9300")
    assert load().server.port == 9300


# --- bad values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "key_path"),
    [
        ({"STREAMFENCE_SERVER_PORT": "eighty"}, "server.port"),
        ({"STREAMFENCE_SERVER_PORT": "70000"}, "server.port"),
        ({"STREAMFENCE_SERVER_PORT": "80.5"}, "server.port"),
        ({"STREAMFENCE_SERVER_WORKERS": "0"}, "server.workers"),
        ({"STREAMFENCE_SERVER_LOG_FORMAT": "xml"}, "server.log_format"),
        ({"STREAMFENCE_SERVER_BOGUS": "1"}, "server.bogus"),
        ({"STREAMFENCE_SERVER_MAX_BODY_BYTES": "0"}, "server.max_body_bytes"),
        ({"STREAMFENCE_SERVER_SHUTDOWN_GRACE": "nan"}, "server.shutdown_grace"),
        ({"STREAMFENCE_TURNS_HEADER": " "}, "turns.header"),
        ({"STREAMFENCE_REGISTRY_BACKEND": "etcd"}, "registry.backend"),
        ({"STREAMFENCE_REGISTRY_ON_UNAVAILABLE": "maybe"}, "registry.on_unavailable"),
        ({"STREAMFENCE_UPSTREAM_0_FINGERPRINT": "maybe"}, "upstream[0].fingerprint"),
        ({"STREAMFENCE_UPSTREAM_0_DIALECT": "cohere"}, "upstream[0].dialect"),
        ({"STREAMFENCE_UPSTREAM_0_ON_RETRY": "sometimes"}, "upstream[0].on_retry"),
        ({"STREAMFENCE_UPSTREAM_0_URL": "ftp://x.test"}, "upstream[0].url"),
        ({"STREAMFENCE_UPSTREAM_0_URL": "http://"}, "upstream[0].url"),
        ({"STREAMFENCE_UPSTREAM_0_PREFIX": "openai"}, "upstream[0].prefix"),
        ({"STREAMFENCE_UPSTREAM_0_PREFIX": "/_streamfence/x"}, "upstream[0].prefix"),
        ({"STREAMFENCE_UPSTREAM_0_IDLE_TIMEOUT": "0"}, "upstream[0].idle_timeout"),
        ({"STREAMFENCE_UPSTREAM_0_CONNECT_TIMEOUT": "-1"}, "upstream[0].connect_timeout"),
        ({"STREAMFENCE_UPSTREAM_0_CONNECT_TIMEOUT": "nan"}, "upstream[0].connect_timeout"),
    ],
)
def test_bad_value_names_its_key_path(env: dict[str, str], key_path: str) -> None:
    problems = problems_of(env={"STREAMFENCE_UPSTREAM_0_URL": "http://127.0.0.1:9", **env})
    assert [p.split(":", 1)[0] for p in problems] == [key_path], problems


@pytest.mark.parametrize(
    ("text", "key_path"),
    [
        ("[server]\nport = 8787.5", "server.port"),
        ("[server]\nport = inf", "server.port"),
        ("[server]\nworkers = 1.5", "server.workers"),
        ("[server]\nport = true", "server.port"),
        ("[server]\nhost = 127", "server.host"),
        ("[server]\nshutdown_grace = nan", "server.shutdown_grace"),
        ("[turns]\nignore_fields = [1, 2]", "turns.ignore_fields"),
        ('[registry]\nlease_ttl = "long"', "registry.lease_ttl"),
    ],
)
def test_bad_file_value_names_its_key_path(tmp_path: Path, text: str, key_path: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    problems = problems_of(path=str(path), env={}, overrides=URL)
    assert [p.split(":", 1)[0] for p in problems] == [key_path], problems


def test_whole_number_floats_are_accepted_for_integers(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[server]\nport = 9000.0\nshutdown_grace = 2\n")
    config = load(str(path), env={}, overrides=URL)
    assert config.server.port == 9000 and isinstance(config.server.port, int)
    assert config.server.shutdown_grace == 2.0


def test_every_problem_is_reported_at_once_with_the_upstream_index() -> None:
    data = {
        "server": {"port": "x", "workers": 0},
        "upstream": [
            {"url": "http://127.0.0.1:9"},
            {"url": "nope", "prefix": "/a", "bogus": 1},
            {"url": "http://127.0.0.1:9", "prefix": "/a/"},
        ],
        "extra": {},
    }
    with pytest.raises(ConfigError) as caught:
        from_dict(data)
    keys = [p.split(":", 1)[0] for p in caught.value.problems]
    assert sorted(keys) == sorted(
        [
            "extra",
            "server.port",
            "server.workers",
            "upstream[1].bogus",
            "upstream[1].url",
            "upstream[2].prefix",  # "/a/" routes exactly what "/a" does
        ]
    )


def test_duplicate_prefixes_are_refused() -> None:
    for prefixes in (["/", "/"], ["/a", "/a"], ["/a", "/a/"], ["/", "//"]):
        data = {"upstream": [{"url": "http://127.0.0.1:9", "prefix": p} for p in prefixes]}
        with pytest.raises(ConfigError) as caught:
            from_dict(data)
        assert caught.value.problems == [
            f"upstream[1].prefix: {prefixes[1]!r} is used by another upstream"
        ]
    ok = {"upstream": [{"url": "http://127.0.0.1:9", "prefix": p} for p in ("/", "/a", "/ab")]}
    assert len(from_dict(ok).upstream) == 3


def test_several_workers_need_the_redis_registry() -> None:
    problems = problems_of(env={}, overrides={**URL, "server.workers": "2"})
    (problem,) = problems
    assert problem.startswith("server.workers: several workers need a shared registry")
    assert "in-memory" in problem and 'backend = "redis"' in problem
    config = load(env={}, overrides={**URL, "server.workers": "2", "registry.backend": "redis"})
    assert config.server.workers == 2


@pytest.mark.parametrize(
    ("text", "overrides", "key_path"),
    [
        # [upstream] instead of [[upstream]], with --upstream or its variable on top.
        ('[upstream]\nurl = "http://127.0.0.1:9"\n', URL, "upstream"),
        ('[upstream]\nurl = "http://127.0.0.1:9"\n', {"upstream.0.prefix": "/a"}, "upstream"),
        ("upstream = [1]\n", URL, "upstream[0]"),
        ("server = 1\n", {**URL, "server.port": 1}, "server"),
    ],
)
def test_mistyped_sections_with_flags_on_top_are_config_errors(
    tmp_path: Path, text: str, overrides: dict[str, Any], key_path: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    problems = problems_of(path=str(path), env={}, overrides=overrides)
    assert key_path in [p.split(":", 1)[0] for p in problems], problems


def test_config_is_immutable() -> None:
    config = load(env={}, overrides=URL)
    assert isinstance(config, Config)
    with pytest.raises(AttributeError):
        config.server.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "header", ["X Turn", "X-Turn:", "X-T\u00fcrn", "X-Turn-\U0001f600", "a\tb"]
)
def test_turn_header_must_be_a_header_name(header: str) -> None:
    problems = problems_of(env={}, overrides={**URL, "turns.header": header})
    assert problems == [f"turns.header: must be an HTTP header name, not {header!r}"]


@pytest.mark.parametrize("header", ["X-Turn-Id", "x-agent-turn", "Turn_ID.v2"])
def test_turn_header_names_that_work(header: str) -> None:
    assert load(env={}, overrides={**URL, "turns.header": header}).turns.header == header


def test_an_environment_upstream_index_is_bounded() -> None:
    with pytest.raises(ConfigError) as info:
        load(env={"STREAMFENCE_UPSTREAM_99999999_URL": "http://127.0.0.1:1"})
    assert info.value.problems == ["upstream[99999999]: at most 256 upstreams"]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("false", False), ("FALSE", False), ("0", False), ("no", False), ("off", False)]
    + [("true", True), ("1", True), ("yes", True), ("On", True)],
)
def test_booleans_from_the_environment_mean_what_they_say(raw: str, expected: bool) -> None:
    env = {
        "STREAMFENCE_UPSTREAM_URL": "http://127.0.0.1:9",
        "STREAMFENCE_UPSTREAM_FINGERPRINT": raw,
    }
    (up,) = load(env=env).upstream
    assert up.fingerprint is expected


# --- ranges, and the key meant --------------------------------------------------------------

SECTIONS = {
    "server": ServerConfig,
    "turns": TurnsConfig,
    "registry": RegistryConfig,
    "upstream": UpstreamConfig,
    "tracing": TracingConfig,
}
# Every numeric setting of the schema, with its type.
NUMBERS = {
    f"{section}.{name}": hint
    for section, cls in SECTIONS.items()
    for name, hint in get_type_hints(cls).items()
    if hint in (int, float)
}
INTEGERS = {key for key, hint in NUMBERS.items() if hint is int}


def test_every_numeric_setting_has_its_range() -> None:
    # A new number in the schema without a range would accept -1 silently, as
    # healthy_within, replay_window and join_buffer_bytes once did.
    assert sorted(NUMBERS) == sorted(RANGES)


def _out_of_range(tmp_path: Path, key: str, value: float) -> str:
    """The one problem a file setting `key` to `value` has."""
    section, name = key.split(".")
    table = (
        f"[[{section}]]\nurl = 'http://127.0.0.1:9'" if section == "upstream" else f"[{section}]"
    )
    path = tmp_path / "c.toml"
    path.write_text(f"{table}\n{name} = {value!r}\n")
    problems = problems_of(path=str(path), env={}, overrides={} if section == "upstream" else URL)
    where = f"upstream[0].{name}" if section == "upstream" else key
    assert [p.split(":", 1)[0] for p in problems] == [where], problems
    return problems[0]


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_numeric_setting_under_its_range_names_its_key_path(tmp_path: Path, key: str) -> None:
    allowed = RANGES[key]
    value: float = allowed.low - 1 if allowed.low_allowed else allowed.low
    value = int(value) if key in INTEGERS else float(value)
    assert _out_of_range(tmp_path, key, value).endswith(f", not {value!r}")


@pytest.mark.parametrize("key", sorted(set(RANGES) - INTEGERS))
def test_an_infinite_duration_names_its_key_path(tmp_path: Path, key: str) -> None:
    # `math.ceil(inf)` in the shutdown timeout was a crash at startup, not a config error.
    assert "must be a finite number" in _out_of_range(tmp_path, key, float("inf"))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("upstream.healthy_within", 0),  # every running generation counts as stalled
        ("upstream.replay_window", 0),
        ("server.write_timeout", 0),
        ("server.shutdown_grace", 0),
        ("server.port", 0),
        ("upstream.join_buffer_bytes", 1),
    ],
)
def test_the_edges_of_the_ranges_are_accepted(key: str, value: float) -> None:
    load(env={}, overrides={**URL, key: value})


# Every setting with fixed choices, and how a wrong value's problem lists them (as users
# read it: the order is the StrEnum's).
CHOICES = {
    "server.log_format": "auto, json, text",
    "server.http_transport": "httpx, fast",
    "registry.backend": "memory, redis",
    "registry.on_unavailable": "fail_open, fail_closed",
    "tracing.enabled": "auto, on, off",
    "upstream.on_retry": "adaptive, supersede, join",
    "upstream.event_ids": "auto, always, never",
}


def test_every_setting_with_choices_is_a_strenum() -> None:
    # Compared with its members across proxy/, never with a string spelled in several files.
    enums = {
        f"{section}.{name}"
        for section, cls in SECTIONS.items()
        for name, hint in get_type_hints(cls).items()
        if isinstance(hint, type) and issubclass(hint, StrEnum)
    }
    assert sorted(enums) == sorted(CHOICES)


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_a_setting_with_choices_loads_as_its_member_and_a_wrong_one_lists_them(key: str) -> None:
    section, name = key.split(".")
    index = "0_" if section == "upstream" else ""
    variable = f"STREAMFENCE_{section.upper()}_{index}{name.upper()}"
    where = f"upstream[0].{name}" if section == "upstream" else key
    enum = get_type_hints(SECTIONS[section])[name]
    for member in enum:
        config = load(env={variable: member.value}, overrides=URL)
        owner = config.upstream[0] if section == "upstream" else getattr(config, section)
        assert getattr(owner, name) is member
    problems = problems_of(env={variable: "bogus"}, overrides=URL)
    assert problems == [f"{where}: must be one of {CHOICES[key]}, not 'bogus' (from {variable})"]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "[[upstream]]\nurl = 'http://127.0.0.1:9'\nheathy_within = 5\n",
            "upstream[0].heathy_within: unknown key (did you mean healthy_within?)",
        ),
        ("[server]\nprot = 1\n", "server.prot: unknown key (did you mean port?)"),
        ("[sever]\nport = 1\n", "sever: unknown section (did you mean server?)"),
        ("[registry]\nonunavailable = 'fail_open'\n", "(did you mean on_unavailable?)"),
    ],
)
def test_an_unknown_key_suggests_the_key_meant(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    problems = problems_of(path=str(path), env={}, overrides={} if "upstream" in text else URL)
    assert any(says in p for p in problems), problems


def test_an_unknown_key_far_from_any_suggests_nothing() -> None:
    (problem,) = problems_of(env={"STREAMFENCE_SERVER_ZQXJ": "1"}, overrides=URL)
    assert problem == "server.zqxj: unknown key (from STREAMFENCE_SERVER_ZQXJ)"


def test_a_toml_syntax_error_names_the_file_once_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('[server]\nport = 1\nhost "x"\n')
    with pytest.raises(ConfigError) as caught:
        load(str(path), env={})
    assert caught.value.where == f"{path}:3:6"
    (problem,) = caught.value.problems
    assert problem == "not valid TOML: Expected '=' after a key in a key/value pair"
    assert str(caught.value).count(str(path)) == 1
