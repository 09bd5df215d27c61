"""The `streamfence` command as a user runs it: a real process, its exit code and what it
prints. Every `--help` exits 0; every mistake is one line on stderr naming what to fix."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.serve import freeze_startup_objects

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**clean, **(env or {})},
        check=False,
    )


def test_startup_objects_are_moved_out_of_the_collectors_sight() -> None:
    # What the process imported is never garbage: a full collection that scanned it all
    # paused the event loop for ~22 ms under load (bench B5).
    before = gc.get_freeze_count()
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(
    ("args", "shows"),
    [
        (["--help"], "check-config"),
        (["help"], "check-config"),
        (["help", "serve"], "--upstream"),
        (["help", "demo"], "--pace"),
        (["help", "check-config"], "FILE"),
        (["serve", "--help"], "--log-level"),
        (["run", "--help"], "--upstream"),
        (["--upstream", "http://127.0.0.1:9", "--help"], "--upstream"),
        (["demo", "--help"], "--no-color"),
        (["check-config", "--help"], "key path"),
        (["--version"], "streamfence 0."),
    ],
)
def test_every_help_exits_zero_on_stdout(args: list[str], shows: str) -> None:
    out = run(*args)
    assert (out.returncode, out.stderr) == (0, "")
    assert shows in out.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--log-level", "verbose", "--upstream", "http://x.test"], "invalid choice: 'verbose'"),
        (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
        (["--log-format", "xml"], "argument --log-format: invalid choice: 'xml'"),
        (["check-config"], "the following arguments are required: FILE"),
        (["help", "nope"], "invalid choice: 'nope'"),
        (["bogus"], "unknown command 'bogus'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_usage_mistakes_are_one_line_and_exit_2(args: list[str], says: str) -> None:
    out = run(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("streamfence") and says in line, line
    assert "--help" in line  # where to look next


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        ([], {"STREAMFENCE_SERVER_PORT": "abc"}, "server.port: must be a number, not 'abc'"),
        ([], {"STREAMFENCE_SERVER_PORT": "abc"}, "(from STREAMFENCE_SERVER_PORT)"),
        (["--port", "70000"], {}, "server.port: must be between 0 and 65535 (from --port)"),
        (["--upstream", "ftp://x.test"], {}, "upstream[0].url: must be an http:// or https://"),
        (["--upstream", "ftp://x.test"], {}, "(from --upstream)"),
        ([], {"STREAMFENCE_UPSTREAM_0_URL": "nope"}, "(from STREAMFENCE_UPSTREAM_0_URL)"),
        ([], {"STREAMFENCE_REGISTRY_ON_UNAVAILABLE": "x"}, "STREAMFENCE_REGISTRY_ON_UNAVAILABLE"),
    ],
)
def test_config_errors_name_the_variable_or_flag_the_value_came_from(
    args: list[str], env: dict[str, str], says: str
) -> None:
    if not any(a == "--upstream" for a in args) and "STREAMFENCE_UPSTREAM_0_URL" not in env:
        args = [*args, "--upstream", "http://127.0.0.1:9"]
    out = run(*args, env=env)
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert line.startswith("streamfence: config error: ") and says in line, line
    assert "listening" not in out.stderr


def test_a_missing_upstream_url_is_required(tmp_path: Path) -> None:
    path = tmp_path / "no-url.toml"
    path.write_text('[[upstream]]\nname = "openai"\n')
    for out in (run("--config", str(path)), run("check-config", str(path))):
        assert out.returncode in (1, 2)
        assert "upstream[0].url: required" in out.stderr, out.stderr
    nothing = run()
    assert nothing.returncode == 2
    (line,) = nothing.stderr.splitlines()
    assert "upstream: at least one upstream is needed (required: --upstream URL" in line


def test_check_config_on_a_valid_file_listens_nowhere(tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text('[[upstream]]\nurl = "https://api.openai.com"\n')
    out = run("check-config", str(path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{path}: ok\n")
    assert "would listen on http://127.0.0.1:8787" in out.stdout
    assert "listening on" not in out.stdout + out.stderr


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_port_in_use_is_one_line_with_the_fix(taken_port: int, fmt: str) -> None:
    out = run("--upstream", "http://127.0.0.1:9", "--port", str(taken_port), "--log-format", fmt)
    assert out.returncode == 1
    (line,) = out.stderr.splitlines()
    text = json.loads(line)["msg"] if fmt == "json" else line
    assert f"cannot listen on 127.0.0.1:{taken_port}: the port is already in use" in text
    assert "--port" in text
    assert "listening on" not in out.stderr  # no banner for a socket it never had


def test_the_banner_comes_once_the_socket_listens() -> None:
    # Port 0: the banner names the port the kernel chose, and the first connection to it
    # (no retry loop) is accepted, because "listening on" is printed after listen().
    with subprocess.Popen(
        [sys.executable, "-m", "proxy", "--upstream", "http://127.0.0.1:9", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    ) as proc:
        try:
            assert proc.stderr is not None
            first = json.loads(proc.stderr.readline())
            assert first["level"] == "info" and first["logger"] == "streamfence.startup"
            url = first["msg"].rsplit(" ", 1)[1]
            assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
            healthz = httpx.get(url + "/_streamfence/healthz", timeout=20)
            assert healthz.json() == {"status": "ok"}
        finally:
            proc.terminate()
        assert proc.wait(20) == 0
