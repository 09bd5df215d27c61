"""config.example.toml stays in sync with the schema, and `streamfence check-config` reports
every problem of a file with its key path."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from proxy import cli
from proxy.config.load import load
from proxy.config.schema import defaults_as_dict

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config.example.toml"
KEY_PATH = re.compile(r"^(server|turns|registry|upstream(\[\d+\])?|\w+)(\.\w+)?: ")


def test_example_has_every_setting_at_its_default() -> None:
    example = tomllib.loads(EXAMPLE.read_text())
    schema = defaults_as_dict()
    assert set(example) == set(schema)
    for section in ("server", "turns", "registry", "tracing"):
        assert set(example[section]) == set(schema[section]), section
        for key, default in schema[section].items():
            shown = example[section][key]
            assert (tuple(shown) if isinstance(shown, list) else shown) == default, key
    (upstream,) = example["upstream"]
    assert set(upstream) == set(schema["upstream"])
    for key, default in schema["upstream"].items():
        if key != "url":  # the one setting without a default
            assert upstream[key] == default, key


def test_every_example_setting_says_why() -> None:
    lines = EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\w+\s*=", line):
            assert lines[i - 1].startswith("# "), f"line {i + 1} ({line!r}) has no comment above"


def test_example_loads_and_checks_clean(capsys: pytest.CaptureFixture[str]) -> None:
    config = load(str(EXAMPLE), env={})
    assert config.upstream[0].url == "https://api.openai.com"
    assert cli.main(["check-config", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{EXAMPLE}: ok\n")
    assert "would listen on http://127.0.0.1:8787" in out
    assert "registry: memory" in out


BAD = """
[server]
port = "eighty"
workers = 0
log_format = "xml"
bogus = 1

[turns]
header = ""
ignore_fields = [1, 2]

[registry]
backend = "etcd"

[[upstream]]
url = "ftp://example.com"
prefix = "nope"
idle_timeout = -1

[[upstream]]
url = "http://127.0.0.1:9"
prefix = "/_streamfence/x"
fingerprint = "maybe"

[extra]
a = 1
"""


def test_check_config_reports_every_problem_with_its_key_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(BAD)
    assert cli.main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    *errors, summary = err
    problems = [line.removeprefix(f"{path}: error: ") for line in errors]
    for problem in problems:
        assert KEY_PATH.match(problem), problem
    keys = {problem.split(":", 1)[0] for problem in problems}
    assert keys == {
        "extra",
        "server.port",
        "server.workers",
        "server.log_format",
        "server.bogus",
        "turns.header",
        "turns.ignore_fields",
        "registry.backend",
        "upstream[0].url",
        "upstream[0].prefix",
        "upstream[0].idle_timeout",
        "upstream[1].prefix",
        "upstream[1].fingerprint",
    }
    assert summary == f"{path}: {len(problems)} problems found"


def test_check_config_ignores_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The file is what is being checked: an environment variable must not paper over it.
    monkeypatch.setenv("STREAMFENCE_UPSTREAM_URL", "https://api.openai.com")
    path = tmp_path / "empty.toml"
    path.write_text("[server]\nport = 9000\n")
    assert cli.main(["check-config", str(path)]) == 2
    assert "upstream: at least one upstream is needed" in capsys.readouterr().err


def test_check_config_on_unreadable_or_broken_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.toml"
    assert cli.main(["check-config", str(missing)]) == 2
    assert capsys.readouterr().err == f"{missing}: error: cannot read: No such file or directory\n"
    broken = tmp_path / "broken.toml"
    broken.write_text('[server]\nport = 1\nhost = "x\n')
    for command in (["check-config", str(broken)], ["--config", str(broken)]):
        assert cli.main(command) == 2
        # One line, naming the file once, with the line and column of the mistake.
        (line,) = capsys.readouterr().err.splitlines()
        assert line.count(str(broken)) == 1, line
        assert f"{broken}:3:10: " in line and "not valid TOML: Illegal character" in line
    assert cli.main(["check-config"]) == 2
    assert "the following arguments are required: FILE" in capsys.readouterr().err


def test_check_config_as_a_command(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(BAD)
    bad = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2  # a config error, as from serve
    assert "upstream[0].url: must be an http:// or https:// URL" in bad.stderr
    good = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert good.returncode == 0, good.stderr
    assert "ok" in good.stdout
