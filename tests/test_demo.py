"""`streamfence demo`, the README's first command, run as a user would: to the end, into a
pipe its reader closes early, interrupted with Ctrl-C, on a terminal with and without
NO_COLOR."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = [sys.executable, "-m", "proxy", "demo"]


def test_demo_shows_the_fence() -> None:
    out = subprocess.run(
        [*DEMO, "--pace", "0.01", "--no-color"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    direct, fenced = out.stdout.split("2) Through streamfence")
    after_direct = direct.split("after the retry:")[1].split("->")[0]
    after_fenced = fenced.split("after the retry:")[1].split("->")[0]
    assert "(1)" in after_direct and "(2)" in after_direct  # the bug, shown without the proxy
    assert "(1)" not in after_fenced and "Seine(2)" in after_fenced
    assert "attempt 1 error: stream_superseded" in fenced
    assert "attempt 1: connection closed after 4 tokens" in fenced
    assert "OK: one writer per turn." in out.stdout
    # Its last line: straight, the provider generated both answers (13 tokens each); through
    # the proxy, 4 of attempt 1's and attempt 2's 13. The requests come from the ledger.
    last = out.stdout.splitlines()[-1]
    assert last == "Spared by the fence: 9 of 26 generated tokens (2 requests upstream, 1 fenced)."
    # The demo lowers healthy_within to fit its pace, and says so, with what the default
    # does: a user who then retried after 4 s with the defaults got "followed", unwarned.
    said = " ".join(fenced.split())
    assert "For the show, healthy_within is 0.02 s (twice the pace)" in said
    assert "The default is 10 s: a retry within 10 s of the last token follows" in said
    too_wide = [line for line in out.stdout.splitlines() if len(line) > 80]
    assert too_wide == []
    assert "\033[" not in out.stdout  # not a terminal: no colours


def test_a_pace_that_is_no_pace_is_refused() -> None:
    # At 0 (or less) the provider's stall is no stall: the demo once ran, showed attempt 1's
    # tokens after the retry, and said "UNEXPECTED" with exit 1.
    for pace in ("0", "-1", "nan"):
        out = subprocess.run(
            [*DEMO, "--pace", pace], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        assert (out.returncode, out.stdout) == (2, "")
        (line,) = out.stderr.splitlines()
        assert f"argument --pace: must be more than 0 seconds, not '{pace}'" in line


def test_a_reader_that_closes_the_pipe_ends_the_demo_quietly() -> None:
    # `streamfence demo | head -3`: the demo notices the closed pipe and exits at once.
    with subprocess.Popen(
        [*DEMO, "--pace", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        head = [proc.stdout.readline() for _ in range(3)]
        proc.stdout.close()
        code = proc.wait(30)  # before the fix: for ever
        err = proc.stderr.read().decode()
    assert head[0].startswith(b"streamfence demo:")
    assert code == 0
    assert err == ""  # no BrokenPipeError, no "Exception ignored"


def _interruptible() -> None:
    # Ctrl-C reaches a terminal's foreground job. A test run started in the background of a
    # shell without job control (`cmd &` in a script, nohup) has SIGINT ignored, and
    # children inherit that: the demo would rightly ignore it and run to its end (exit 0).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_the_demo_without_a_traceback() -> None:
    with subprocess.Popen(
        [*DEMO, "--pace", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        preexec_fn=_interruptible,  # noqa: PLW1509 - the child's own signal disposition
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        while "POST /v1/chat/completions" not in proc.stdout.readline():
            pass  # the scripted servers are up and the first attempt is streaming
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
        err = proc.stderr.read()
    assert code == 130  # 128 + SIGINT, what a shell shows for Ctrl-C
    assert err == ""


def _on_a_terminal(env: dict[str, str]) -> str:
    controller, terminal = pty.openpty()
    with subprocess.Popen(
        [*DEMO, "--pace", "0.005"], stdout=terminal, stderr=subprocess.DEVNULL, cwd=ROOT, env=env
    ) as proc:
        os.close(terminal)
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the demo exited and closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(60) == 0
    os.close(controller)
    return b"".join(chunks).decode()


def test_colours_on_a_terminal_unless_no_color() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    assert "\033[" in _on_a_terminal(env)
    plain = _on_a_terminal({**env, "NO_COLOR": "1"})
    assert "OK: one writer per turn." in plain and "\033[" not in plain
