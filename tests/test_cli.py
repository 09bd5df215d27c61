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

from proxy.server.serve import freeze_startup_objects

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
        (["--port", "70000"], {}, "server.port: must be between 0 and 65535, not 70000"),
        (["--port", "70000"], {}, "(from --port)"),
        (["--upstream", "ftp://x.test"], {}, "upstream[0].url: must be an http:// or https://"),
        (["--upstream", "ftp://x.test"], {}, "(from --upstream)"),
        ([], {"STREAMFENCE_UPSTREAM_0_URL": "nope"}, "(from STREAMFENCE_UPSTREAM_0_URL)"),
        ([], {"STREAMFENCE_REGISTRY_ON_UNAVAILABLE": "x"}, "STREAMFENCE_REGISTRY_ON_UNAVAILABLE"),
        (
            [],
            {"STREAMFENCE_UPSTREAM_HEATHY_WITHIN": "5"},
            "upstream[0].heathy_within: unknown key (did you mean healthy_within?) "
            "(from STREAMFENCE_UPSTREAM_HEATHY_WITHIN)",
        ),
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
        assert out.returncode == 2
        assert "upstream[0].url: required" in out.stderr, out.stderr
    port_only = run("--port", "9000")  # options, but no upstream
    assert port_only.returncode == 2
    (line,) = port_only.stderr.splitlines()
    assert "upstream: at least one upstream is needed (required: --upstream URL" in line


@pytest.mark.parametrize(
    ("args", "file"),
    [
        (["check-config", "{bad}"], "bad"),
        (["check-config", "{missing}"], "missing"),
        (["check-config", "{broken}"], "broken"),
        (["--config", "{bad}"], "bad"),
        (["serve", "--config", "{broken}"], "broken"),
        (["--config", "{missing}"], "missing"),
        (["demo", "--pace", "0"], ""),
        (["demo", "--pace", "-1"], ""),
        (["demo", "--pace", "inf"], ""),
        (["check-config", "a", "b"], ""),
        (["help", "serve", "extra"], ""),
    ],
)
def test_a_config_error_or_a_usage_mistake_exits_2_from_every_command(
    tmp_path: Path, args: list[str], file: str
) -> None:
    files = {
        "bad": tmp_path / "bad.toml",
        "broken": tmp_path / "broken.toml",
        "missing": tmp_path / "missing.toml",
    }
    files["bad"].write_text("[[upstream]]\nurl = 'http://127.0.0.1:9'\nhealthy_within = -1\n")
    files["broken"].write_text("[server\n")
    out = run(*[a.format(**files) for a in args])
    assert out.returncode == 2, out.stderr
    assert out.stdout == "" and out.stderr.strip(), out
    assert "Traceback" not in out.stderr
    if file in ("missing", "broken"):  # a problem of the file itself names it
        assert str(files[file]) in out.stderr


def test_streamfence_alone_says_how_to_start() -> None:
    # A first-time user's first command: how to start, the demo and --help, not a config
    # error about upstreams.
    out = run()
    assert out.returncode == 2
    assert out.stdout == ""
    assert "config error" not in out.stderr
    for step in ("streamfence --upstream https://", "streamfence demo", "streamfence --help"):
        assert step in out.stderr, out.stderr
    assert all(len(line) <= 80 for line in out.stderr.splitlines())


def test_streamfence_alone_serves_an_upstream_from_the_environment() -> None:
    # The Docker image's way: no arguments, STREAMFENCE_UPSTREAM_URL set.
    with subprocess.Popen(
        [sys.executable, "-m", "proxy"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")},
            "STREAMFENCE_UPSTREAM_URL": "http://127.0.0.1:9",
            "STREAMFENCE_SERVER_PORT": "0",
        },
    ) as proc:
        try:
            assert proc.stderr is not None
            assert "listening on http://127.0.0.1:" in proc.stderr.readline()
        finally:
            proc.terminate()
        assert proc.wait(20) == 0


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
