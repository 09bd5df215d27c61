"""The pi coding agent (`pi --mode json ...`, @mariozechner/pi-coding-agent from npm) with a
custom OpenAI-compatible provider at the proxy (chat completions), against the scripted
upstream.

What it tried outside loopback when this was written (strace): nothing, in print and JSON
mode; PI_OFFLINE keeps its startup checks (a version check and an install ping to pi.dev)
off in every mode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.agents import pi_argv
from tests.agents.harness import FAKE_KEY, Agent, Finished, base_env
from tests.scripted import Seen

PROVIDER = "streamfence"
MODEL = "test-model"


class PiHome:
    """A HOME with ~/.pi/agent/models.json naming the proxy as an OpenAI-compatible provider.
    `settings` goes into ~/.pi/agent/settings.json (e.g. {"retry": {"enabled": False}}).
    Processes that share one (in one working directory, on one day) send byte-identical
    requests for one prompt: the body carries the date and the working directory, and for
    a provider that is not api.openai.com no session id."""

    def __init__(self, root: Path, base_url: str, settings: dict[str, Any] | None = None) -> None:
        self.home = root / "home"
        self.cwd = root / "work"
        agent_dir = self.home / ".pi" / "agent"
        agent_dir.mkdir(parents=True, exist_ok=True)
        self.cwd.mkdir(exist_ok=True)
        provider = {
            "baseUrl": f"{base_url}/v1",
            "api": "openai-completions",
            "apiKey": "STREAMFENCE_TEST_KEY",  # the name of the variable holding the key
            "models": [{"id": MODEL}],
        }
        (agent_dir / "models.json").write_text(json.dumps({"providers": {PROVIDER: provider}}))
        quiet = {"enableInstallTelemetry": False, "quietStartup": True}
        (agent_dir / "settings.json").write_text(json.dumps({**quiet, **(settings or {})}))
        self.env = {**base_env(self.home), "PI_OFFLINE": "1", "STREAMFENCE_TEST_KEY": FAKE_KEY}

    def agent(self, prompt: str) -> Agent:
        model = f"{PROVIDER}/{MODEL}"
        argv = [*pi_argv(), "--model", model, "--no-session", "--mode", "json", prompt]
        return Agent(argv, self.env, self.cwd)


@dataclass
class PiOutcome:
    text: str  # the text of its last assistant message
    stop: str  # that message's stopReason ("stop", "error", ...)
    error: str  # its errorMessage ("" when none)
    retries: list[str]  # the error of each auto_retry_start, in order


def pi_outcome(done: Finished) -> PiOutcome:
    """pi's `--mode json` output: one JSON event a line."""
    last: dict[str, Any] | None = None
    retries: list[str] = []
    for line in done.stdout.splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        message = event.get("message") or {}
        if event.get("type") == "message_end" and message.get("role") == "assistant":
            last = message
        elif event.get("type") == "auto_retry_start":
            retries.append(str(event.get("errorMessage")))
    assert last is not None, f"no assistant message: {done}"
    text = "".join(c.get("text", "") for c in last.get("content", []) if c.get("type") == "text")
    return PiOutcome(text, str(last.get("stopReason")), last.get("errorMessage") or "", retries)


def is_pi_turn(seen: Seen) -> bool:
    return seen.method == "POST" and seen.path == "/v1/chat/completions"
