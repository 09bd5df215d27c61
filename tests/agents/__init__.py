"""Real coding agents started as processes against the scripted upstream through the proxy:
Claude Code, Codex CLI, Gemini CLI and pi from npm (`npm ci --prefix tests/agents`), and
aider from PyPI in an environment of its own (tests/agents/aider: its exact pins would
conflict with the project's; scripts/test installs it into .venv-aider).

`codex_binary()` and `claude_binary()` return the agents' native executables (the npm
packages ship them in per-platform packages); other test modules (the WebSocket tests)
use `codex_binary()` too. `gemini_argv()`, `pi_argv()` and `aider_argv()` return the
command that starts the others. Without their install they skip, except under CI, where a
missing install is a failure rather than a silent skip.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NODE_MODULES = HERE / "node_modules"
AIDER_ENV = HERE.parent.parent / ".venv-aider"
AIDER_INSTALL = (
    'UV_PROJECT_ENVIRONMENT="$PWD/.venv-aider" scripts/uv sync --frozen '
    "--project tests/agents/aider --python 3.11"
)

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


def _missing(what: str, path: Path, install: str = "npm ci --prefix tests/agents") -> None:
    message = f"{what} not installed at {path}: run `{install}`"
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


def _node_script(what: str, path: Path) -> list[str]:
    node = shutil.which("node")
    if node is None:
        _missing(f"{what} (Node.js)", Path("node"), "apt-get install nodejs")
    if not path.is_file():
        _missing(what, path)
    return [str(node), str(path)]


def gemini_argv() -> list[str]:
    """Gemini CLI's bundled entry point (@google/gemini-cli), run by node."""
    return _node_script(
        "Gemini CLI", NODE_MODULES / "@google" / "gemini-cli" / "bundle" / "gemini.js"
    )


def pi_argv() -> list[str]:
    """The pi coding agent's command line (@mariozechner/pi-coding-agent), run by node."""
    path = NODE_MODULES / "@mariozechner" / "pi-coding-agent" / "dist" / "cli.js"
    return _node_script("pi", path)


def aider_argv() -> list[str]:
    """aider's console script in its own environment (.venv-aider, from tests/agents/aider)."""
    path = AIDER_ENV / "bin" / "aider"
    if not path.is_file():
        _missing("aider", path, AIDER_INSTALL)
    return [str(path)]
