"""The examples run as written: each client snippet is executed as a subprocess against the
proxy and the scripted upstream on loopback, and the compose file wires what it claims."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from proxy.config.load import load
from tests.conftest import ProxyFactory
from tests.scripted import ScriptedUpstream

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TOKEN = "example-token"


async def _run(*command: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *command,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_sdk_snippets_stream_through_the_proxy(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory
) -> None:
    async with make_proxy(upstream.url, **{"server.access_token": TOKEN}) as proxy:
        env = {
            "STREAMFENCE_URL": proxy.url,
            "STREAMFENCE_TOKEN": TOKEN,
            "OPENAI_API_KEY": "sk-example",
            "ANTHROPIC_API_KEY": "sk-ant-example",
        }
        for snippet in ("openai_client.py", "anthropic_client.py"):
            code, out, err = await _run(sys.executable, str(EXAMPLES / snippet), env=env)
            assert code == 0, err
            assert out == "0 1 2 \n", (snippet, out)
    assert [s.path for s in upstream.seen] == ["/v1/chat/completions", "/v1/messages"]
    assert all("x-streamfence-token" not in s.headers for s in upstream.seen)
    assert all("x-turn-id" not in s.headers for s in upstream.seen)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_snippet(upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> None:
    async with make_proxy(upstream.url, **{"server.access_token": TOKEN}) as proxy:
        env = {"STREAMFENCE_URL": proxy.url, "STREAMFENCE_TOKEN": TOKEN}
        code, out, err = await _run("sh", str(EXAMPLES / "curl.sh"), env=env)
    assert code == 0, err
    assert "x-streamfence-turn:" in out.lower() and "x-streamfence-attempt: 1" in out.lower()
    assert "data: [DONE]" in out
    assert '{"status":"ok"}' in out
    assert 'streamfence_requests_total{dialect="openai-chat"' in out


def test_compose_runs_the_proxy_as_a_private_sidecar() -> None:
    compose = yaml.safe_load((EXAMPLES / "docker-compose.yml").read_text())
    proxy, agent = compose["services"]["streamfence"], compose["services"]["agent"]
    assert (EXAMPLES / proxy["build"]["context"] / "Dockerfile").is_file()
    for binding in proxy.get("ports", []):  # published only on the host's loopback, if at all
        assert str(binding).startswith("127.0.0.1:")
    mount = next(v for v in proxy["volumes"] if v.endswith(":ro"))
    assert mount.split(":")[1] == proxy["command"][proxy["command"].index("--config") + 1]
    assert agent["environment"]["OPENAI_BASE_URL"] == "http://streamfence:8787/v1"
    assert agent["depends_on"]["streamfence"]["condition"] == "service_healthy"
    assert set(proxy["networks"]) == set(agent["networks"])
    # The proxy's environment names real settings, and they load over the example config.
    env = {k: "x" if "${" in str(v) else str(v) for k, v in proxy["environment"].items()}
    config = load(str(ROOT / "config.example.toml"), env=env)
    assert config.server.access_token == "x"
