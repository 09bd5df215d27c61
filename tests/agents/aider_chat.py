"""aider (`aider --message ...`, aider-chat from PyPI, in .venv-aider) with an OpenAI-compatible
model at the proxy (`--openai-api-base`, chat completions through litellm and the openai
SDK), against the scripted upstream.

What it tried outside loopback when this was written (strace): with the flags and the
model metadata file below, nothing. Without the metadata file it fetches litellm's model
price list from raw.githubusercontent.com (and carries on when that fails); without
--no-check-update it asks PyPI for a newer aider; analytics (PostHog, Mixpanel) are off with
--analytics-disable.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.agents import aider_argv
from tests.agents.harness import FAKE_KEY, Agent, Finished, base_env
from tests.scripted import Seen

MODEL = "openai/test-model"  # litellm's "openai/" prefix: any OpenAI-compatible server

# What aider would otherwise look up on GitHub for a model litellm does not know.
METADATA = {
    MODEL: {
        "max_input_tokens": 128000,
        "max_output_tokens": 4096,
        "input_cost_per_token": 0,
        "output_cost_per_token": 0,
        "litellm_provider": "openai",
        "mode": "chat",
    }
}

QUIET = [
    "--no-git",
    "--no-check-update",
    "--analytics-disable",
    "--no-show-release-notes",
    "--no-show-model-warnings",
    "--no-pretty",
    "--no-fancy-input",
    "--map-tokens",
    "0",
    "--yes-always",
]


class AiderHome:
    """A HOME and a working directory for aider. Processes that share them send
    byte-identical requests for one prompt (the body has no session id). `args` are
    added to every command line (e.g. ["--timeout", "2"]: its socket read timeout)."""

    def __init__(self, root: Path, base_url: str, args: list[str] | None = None) -> None:
        self.home = root / "home"
        self.cwd = root / "work"
        for d in (self.home, self.cwd):
            d.mkdir(parents=True, exist_ok=True)
        metadata = root / "model-metadata.json"
        metadata.write_text(json.dumps(METADATA))
        self.args = ["--model", MODEL, "--openai-api-base", f"{base_url}/v1"]
        self.args += ["--model-metadata-file", str(metadata), *QUIET, *(args or [])]
        self.env = {**base_env(self.home), "OPENAI_API_KEY": FAKE_KEY}
        # litellm's own copy of the model list, not the one on GitHub.
        self.env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

    def agent(self, prompt: str) -> Agent:
        return Agent([*aider_argv(), *self.args, "--message", prompt], self.env, self.cwd)


def aider_reply(done: Finished) -> str:
    """What aider printed as the model's answer: with --no-pretty the text comes between
    its banner (ending with the "Repo-map:" line) and the "Tokens:" report."""
    lines = done.stdout.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("Repo-map:")) + 1
        end = next(
            i for i in range(len(lines) - 1, start - 1, -1) if lines[i].startswith("Tokens:")
        )
    except StopIteration:
        raise AssertionError(f"no answer in aider's output: {done}") from None
    return "\n".join(lines[start:end]).strip()


def is_aider_turn(seen: Seen) -> bool:
    return seen.method == "POST" and seen.path == "/v1/chat/completions"
