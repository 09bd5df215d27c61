"""`streamfence demo`, the README's first command, run as a user would."""

from __future__ import annotations

import subprocess
import sys


def test_demo_shows_the_fence() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "demo", "--pace", "0.01", "--no-color"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    direct, fenced = out.stdout.split("2) Through streamfence")
    after_direct = direct.split("after the retry:")[1].splitlines()[0]
    after_fenced = fenced.split("after the retry:")[1].splitlines()[0]
    assert "(1)" in after_direct and "(2)" in after_direct  # the bug, shown without the proxy
    assert "(1)" not in after_fenced and "Seine(2)" in after_fenced
    assert "attempt 1  error: stream_superseded" in fenced
    assert "attempt 1: connection closed after 4 tokens" in fenced
    assert "OK: one writer per turn." in out.stdout
