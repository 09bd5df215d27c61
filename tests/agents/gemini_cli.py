"""Gemini CLI (`gemini -p ... --output-format json`, @google/gemini-cli from npm) with an API
key and its base URL at the proxy, against the scripted upstream speaking Gemini's
streamGenerateContent.

What it tried outside loopback when this was written (strace): with the settings below,
nothing; with usage statistics left on it looks up play.googleapis.com (Clearcut) and
carries on when that fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.agents import gemini_argv
from tests.agents.harness import FAKE_KEY, Agent, Finished, base_env
from tests.scripted import Script, Seen

# A fixed model: with the default ("auto") Gemini CLI first asks a router model, without
# streaming, which of two models should answer, and expects JSON back.
MODEL = "gemini-2.5-flash"

SETTINGS: dict[str, Any] = {
    # An API key, not a Google login: without a selected type `gemini -p` stops with
    # "Invalid auth method selected." (exit status 41), GOOGLE_GEMINI_BASE_URL or not.
    "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
    "privacy": {"usageStatisticsEnabled": False},  # Clearcut logging to play.googleapis.com
    "telemetry": {"enabled": False},
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
}


class GeminiHome:
    """A HOME with ~/.gemini/settings.json as above. Processes that share one (in one working
    directory, on one day) send byte-identical requests for one prompt: the body carries the
    date, the working directory and a temporary directory under the home, and no session id."""

    def __init__(self, root: Path, base_url: str, **env: str) -> None:
        self.home = root / "home"
        self.cwd = root / "work"
        (self.home / ".gemini").mkdir(parents=True, exist_ok=True)
        self.cwd.mkdir(exist_ok=True)
        (self.home / ".gemini" / "settings.json").write_text(json.dumps(SETTINGS))
        self.env = {**base_env(self.home), **env}
        self.env["GOOGLE_GEMINI_BASE_URL"] = base_url
        self.env["GEMINI_API_KEY"] = FAKE_KEY
        # It restarts itself in a child process to raise Node's heap limit: one process
        # instead, which the harness can kill.
        self.env["GEMINI_CLI_NO_RELAUNCH"] = "true"

    def agent(self, prompt: str) -> Agent:
        argv = [*gemini_argv(), "-m", MODEL, "-p", prompt, "--output-format", "json"]
        return Agent(argv, self.env, self.cwd)


def gemini_result(done: Finished) -> dict[str, Any]:
    """Gemini CLI's --output-format json object: "response" (the answer), "stats", and
    "error" when the turn failed."""
    start = done.stdout.find("{")
    try:
        result = json.loads(done.stdout[start:]) if start >= 0 else None
    except ValueError:
        result = None
    assert isinstance(result, dict), f"no JSON result: {done}"
    return result


def gemini_requests(result: dict[str, Any]) -> dict[str, Any]:
    """The API counters of its stats: totalRequests, totalErrors, errorsByType."""
    api: dict[str, Any] = result["stats"]["models"][MODEL]["api"]
    return api


def gemini_events(tokens: list[str]) -> list[str]:
    """A streamGenerateContent SSE body Gemini CLI takes as complete: one chunk per token,
    then a finishReason (without one it reports NO_FINISH_REASON and asks again, up to 4
    times, appending each attempt's text to the answer)."""

    def event(text: str, **extra: Any) -> str:
        candidate = {"content": {"parts": [{"text": text}], "role": "model"}, "index": 0}
        body = {"candidates": [{**candidate, **extra.pop("candidate", {})}], **extra}
        return f"data: {json.dumps(body)}\r\n\r\n"  # CRLF, as Google's API sends it

    usage = {"promptTokenCount": 1, "candidatesTokenCount": len(tokens), "totalTokenCount": 9}
    last = event("", candidate={"finishReason": "STOP"}, usageMetadata=usage)
    return [event(t) for t in tokens] + [last]


def gemini_script(tokens: list[str], **kw: Any) -> Script:
    return Script(raw=gemini_events(tokens), **kw)


def is_gemini_turn(seen: Seen) -> bool:
    return seen.method == "POST" and ":streamGenerateContent" in seen.path
