"""Real coding agents from npm (Claude Code, Codex CLI) started as processes against the
scripted upstream through the proxy. Install them with `npm ci --prefix tests/agents`.

`codex_binary()` and `claude_binary()` return the agents' native executables (the npm
packages ship them in per-platform packages); other test modules (the WebSocket tests)
use `codex_binary()` too. Without node_modules they skip, except under CI, where a missing
install is a failure rather than a silent skip.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NODE_MODULES = HERE / "node_modules"

# Rust target triples inside @openai/codex-<platform>/vendor/ (the Linux builds are musl).
_CODEX_TRIPLES = {
    ("Linux", "x86_64"): ("linux-x64", "x86_64-unknown-linux-musl"),
    ("Linux", "aarch64"): ("linux-arm64", "aarch64-unknown-linux-musl"),
    ("Darwin", "x86_64"): ("darwin-x64", "x86_64-apple-darwin"),
    ("Darwin", "arm64"): ("darwin-arm64", "aarch64-apple-darwin"),
}
_CLAUDE_PLATFORMS = {
    ("Linux", "x86_64"): "linux-x64",
    ("Linux", "aarch64"): "linux-arm64",
    ("Darwin", "x86_64"): "darwin-x64",
    ("Darwin", "arm64"): "darwin-arm64",
}


def _missing(what: str, path: Path) -> None:
    message = f"{what} not installed at {path}: run `npm ci --prefix tests/agents`"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(message)
    pytest.skip(message)


def _platform() -> tuple[str, str]:
    return platform.system(), platform.machine()


def codex_binary() -> Path:
    """The Codex CLI's native executable from the @openai/codex npm package."""
    key = _platform()
    if key not in _CODEX_TRIPLES:
        pytest.skip(f"no Codex CLI build for {key}")
    package, triple = _CODEX_TRIPLES[key]
    path = NODE_MODULES / "@openai" / f"codex-{package}" / "vendor" / triple / "bin" / "codex"
    if not path.is_file():
        _missing("Codex CLI", path)
    return path


def claude_binary() -> Path:
    """Claude Code's native executable from the @anthropic-ai/claude-code npm package.

    Taken from the platform package itself: the wrapper's bin/claude.exe is only a stub
    until its postinstall script has copied the binary over it.
    """
    key = _platform()
    if key not in _CLAUDE_PLATFORMS:
        pytest.skip(f"no Claude Code build for {key}")
    package = f"claude-code-{_CLAUDE_PLATFORMS[key]}"
    path = NODE_MODULES / "@anthropic-ai" / package / "claude"
    if not path.is_file():
        _missing("Claude Code", path)
    return path
