"""Starting Claude Code and Codex CLI as processes with a fake key, a throwaway home and
their base URL at the proxy; and what the scripted upstream must send each of them.

Each agent gets an environment built from nothing (no proxy variables, no real keys from
the developer's shell): PATH, HOME and what the agent needs. What the agents tried outside
loopback when this was written (strace): Claude Code, with the variables below, nothing;
Codex CLI looks up github.com and chatgpt.com (plugin and model sync) and carries on when
that fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import tomllib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from proxy.config.load import load
from proxy.server.app import create_app
from tests.agents import claude_binary, codex_binary
from tests.scripted import Script, ScriptedUpstream, Seen, serve

FAKE_KEY = "sk-streamfence-agent-test"
RUN_TIMEOUT = 60.0  # seconds for one agent process, whatever it does


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


class Agent:
    """One agent process: start() it, then finish() for its exit code and output."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.argv, self.env, self.cwd = argv, env, cwd
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> Agent:
        RUNNING.add(self)
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            cwd=self.cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return self

    @property
    def exited(self) -> bool:
        return self._proc is not None and self._proc.returncode is not None

    async def exit(self) -> None:
        """Until the process has exited (its output stays unread until finish())."""
        assert self._proc is not None, "start() first"
        await self._proc.wait()

    async def finish(self, limit: float = RUN_TIMEOUT) -> Finished:
        proc = self._proc
        assert proc is not None, "start() first"
        try:
            out, err = await asyncio.wait_for(proc.communicate(), limit)
        except TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
            raise AssertionError(
                f"{self.argv[0]} still running after {limit} s\nstdout: {out.decode()}\n"
                f"stderr: {err.decode()[-3000:]}"
            ) from None
        assert proc.returncode is not None
        RUNNING.discard(self)
        return Finished(proc.returncode, out.decode(), err.decode())

    async def kill(self) -> None:
        """End the process if it still runs (a test that failed before finish())."""
        RUNNING.discard(self)
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.communicate()

    async def run(self, limit: float = RUN_TIMEOUT) -> Finished:
        await self.start()
        return await self.finish(limit)


RUNNING: set[Agent] = set()  # started and not finished: tests/agents/conftest.py reaps them


def base_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"}


# --- Claude Code -------------------------------------------------------------------------

# Everything Claude Code can be told to leave out that would reach outside hosts.
CLAUDE_QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
}


class ClaudeHome:
    """A HOME for Claude Code. Processes that share one (with one --session-id, in one
    working directory) send byte-identical requests for one prompt: the request carries
    the home's user id, the session id and the memory directory's path. Without
    --no-session-persistence the second of them would refuse to start ("Session ID ... is
    already in use": the first one's transcript file exists)."""

    def __init__(self, root: Path, base_url: str, **env: str) -> None:
        self.home = root / "home"
        self.cwd = root / "work"
        self.home.mkdir(parents=True, exist_ok=True)
        self.cwd.mkdir(exist_ok=True)
        # A fixed user id: two first starts at once would each make one up.
        (self.home / ".claude.json").write_text(json.dumps({"userID": "a" * 64}))
        self.session = str(uuid.uuid4())
        self.env = {**base_env(self.home), **CLAUDE_QUIET, **env}
        self.env["ANTHROPIC_BASE_URL"] = base_url
        self.env["ANTHROPIC_API_KEY"] = FAKE_KEY

    def agent(self, prompt: str) -> Agent:
        argv = [str(claude_binary()), "-p", prompt, "--output-format", "json"]
        argv += ["--session-id", self.session, "--no-session-persistence"]
        return Agent(argv, self.env, self.cwd)


def claude_result(done: Finished) -> dict[str, Any]:
    """Claude Code's --output-format json result object (it prints one even on API errors)."""
    try:
        result = done.json()
    except ValueError:
        raise AssertionError(f"no JSON result: {done}") from None
    assert isinstance(result, dict) and result.get("type") == "result", result
    return result


def is_claude_turn(seen: Seen) -> bool:
    return seen.method == "POST" and seen.path == "/v1/messages"


def claude_upstream(turn: Callable[[Any], Script]) -> Callable[[str, Any], Script]:
    """An upstream `choose` for Claude Code: `turn(body)` scripts its Messages requests; a
    token count (POST /v1/messages/count_tokens, which it may send too) gets a plausible
    answer rather than a Messages body."""

    def choose(path: str, body: Any) -> Script:
        if path.endswith("/count_tokens"):
            return Script(stream=False, json_body={"input_tokens": 1})
        return turn(body)

    return choose


# --- Codex CLI ---------------------------------------------------------------------------


class CodexHome:
    """A CODEX_HOME with a custom model provider at the proxy (Responses API over HTTP).
    `provider` adds or overrides keys of the provider's table (e.g. stream_idle_timeout_ms);
    `extra_toml` is appended to config.toml as it is (other tables)."""

    def __init__(self, root: Path, base_url: str, extra_toml: str = "", **provider: Any) -> None:
        self.home = root / "home"
        self.codex_home = root / "codex"
        self.cwd = root / "work"
        for d in (self.home, self.codex_home, self.cwd):
            d.mkdir(parents=True, exist_ok=True)
        settings: dict[str, Any] = {
            "name": "streamfence",
            "base_url": f"{base_url}/v1",
            "wire_api": "responses",
            "env_key": "STREAMFENCE_TEST_KEY",
            # Codex's defaults: 4 request retries, 5 stream retries, 300 s idle timeout.
            **provider,
        }
        lines = [
            'model = "test-model"',
            'model_provider = "streamfence"',
            "check_for_update_on_startup = false",
            "",
            "[model_providers.streamfence]",
        ]
        lines += [f"{k} = {_toml(v)}" for k, v in settings.items()]
        text = "\n".join(lines) + "\n" + extra_toml
        tomllib.loads(text)  # fail here, not inside Codex, on a malformed file
        (self.codex_home / "config.toml").write_text(text)
        self.env = {**base_env(self.home), "CODEX_HOME": str(self.codex_home)}
        self.env["STREAMFENCE_TEST_KEY"] = FAKE_KEY

    def agent(self, prompt: str) -> Agent:
        argv = [str(codex_binary()), "exec", "--skip-git-repo-check", "--json", prompt]
        return Agent(argv, self.env, self.cwd)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


@dataclass
class CodexOutcome:
    text: str  # the agent's final message ("" when none)
    errors: list[str]  # error messages it reported, in order (reconnects included)
    completed: bool  # a turn.completed event


def codex_outcome(done: Finished) -> CodexOutcome:
    """Codex's `exec --json` output: one JSON event a line."""
    texts: list[str] = []
    errors: list[str] = []
    completed = False
    for line in done.stdout.splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        kind = event.get("type")
        item = event.get("item") or {}
        if kind == "item.completed" and item.get("type") == "agent_message":
            texts.append(item.get("text", ""))
        elif kind == "error":
            errors.append(str(event.get("message")))
        elif kind == "turn.failed":
            errors.append(str((event.get("error") or {}).get("message")))
        elif kind == "turn.completed":
            completed = True
    return CodexOutcome("".join(texts), errors, completed)


def codex_events(tokens: list[str], response_id: str = "resp_1") -> list[str]:
    """A Responses stream Codex accepts. It needs response.output_item.done with the whole
    message and then response.completed; the text deltas alone (with no item added first)
    it drops ("OutputTextDelta without active item"), and response.created is optional.
    The deltas come one per event so that a test can hold the stream between them."""

    def sse(data: dict[str, Any]) -> str:
        return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"

    response = {"id": response_id, "object": "response", "created_at": 1, "model": "m"}
    item = {"type": "message", "id": "msg_1", "role": "assistant", "content": []}
    done_item = {
        **item,
        "status": "completed",
        "content": [{"type": "output_text", "text": "".join(tokens), "annotations": []}],
    }
    usage = {"input_tokens": 1, "output_tokens": len(tokens), "total_tokens": 1 + len(tokens)}
    events = [
        sse({"type": "response.created", "response": {**response, "status": "in_progress"}}),
        sse({"type": "response.output_item.added", "output_index": 0, "item": item}),
    ]
    events += [
        sse(
            {
                "type": "response.output_text.delta",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": t,
            }
        )
        for t in tokens
    ]
    events += [
        sse({"type": "response.output_item.done", "output_index": 0, "item": done_item}),
        sse(
            {
                "type": "response.completed",
                "response": {**response, "status": "completed", "output": [], "usage": usage},
            }
        ),
    ]
    return events


def codex_script(tokens: list[str], **kw: Any) -> Script:
    return Script(raw=codex_events(tokens), **kw)


def is_codex_turn(seen: Seen) -> bool:
    return seen.method == "POST" and seen.path == "/v1/responses"


# --- the upstream and the proxy, seen from outside ---------------------------------------


def sse_data(body: str) -> list[dict[str, Any]]:
    """The JSON of each `data:` line of an SSE body, in order."""
    return [
        json.loads(line[6:])
        for block in body.split("\n\n")
        for line in block.splitlines()
        if line.startswith("data: ") and line[6:].startswith("{")
    ]


def superseded_frames(body: str) -> list[dict[str, Any]]:
    """The proxy's superseded frames in an SSE body (Responses or Anthropic dialect)."""

    def kind(event: dict[str, Any]) -> Any:
        inner = event.get("error")
        return event.get("code") or (inner.get("type") if isinstance(inner, dict) else None)

    return [
        e for e in sse_data(body) if e.get("type") == "error" and kind(e) == "stream_superseded"
    ]


def same_turn(seen: list[Seen], first: Seen, ignore: tuple[str, ...] = ("stream",)) -> list[Seen]:
    """The requests whose body equals `first`'s apart from the `ignore` fields: one turn's
    attempts (the key order of the JSON may differ between an agent's retries)."""

    def canon(s: Seen) -> Any:
        try:
            body = json.loads(s.body)
        except ValueError:
            return None
        if isinstance(body, dict):
            for name in ignore:
                body.pop(name, None)
        return body

    want = canon(first)
    return [s for s in seen if s.path == first.path and canon(s) == want]


def streaming(seen: Seen) -> bool:
    return bool(json.loads(seen.body).get("stream"))


async def wait_for(upstream: ScriptedUpstream, pred: Any, limit: float = 30.0) -> Seen:
    """The first request the upstream has seen (or will see) for which pred holds."""

    async def find() -> Seen:
        n = 0
        while True:
            seen = await upstream.wait_requests(n + 1)
            for s in seen[n:]:
                if pred(s):
                    return s
            n = len(seen)

    return await asyncio.wait_for(find(), limit)


@dataclass
class Exchange:
    """One request the proxy received from a client, as its ASGI app saw it."""

    path: str
    body: bytes = b""  # as far as the proxy has read it
    headers: dict[str, str] | None = None  # the response's, once it started


class Watched:
    """The proxy's ASGI app, wrapped to record when each client request's response starts:
    by then the proxy has decided what the request is (a new generation, a follower, ...),
    which a test can wait on instead of timing. Its own /_streamfence/ paths are left out."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.exchanges: list[Exchange] = []
        self._changed = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/_streamfence/"):
            await self.app(scope, receive, send)
            return
        exchange = Exchange(scope["path"])
        self.exchanges.append(exchange)

        async def watched_receive() -> dict[str, Any]:
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                exchange.body += message.get("body", b"")
            return message

        async def watched_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                exchange.headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
                self._changed.set()
            await send(message)

        await self.app(scope, watched_receive, watched_send)

    def started(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.headers is not None]

    async def wait_started(self, n: int, limit: float = 30.0) -> list[Exchange]:
        """Until the responses of at least n client requests have started."""

        async def started() -> None:
            while len(self.started()) < n:
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(started(), limit)
        except TimeoutError:
            raise AssertionError(
                f"{len(self.started())} of {n} responses started within {limit} s: "
                f"{self.describe()}"
            ) from None
        return self.started()

    def describe(self) -> str:
        return "; ".join(
            f"{e.path} ({len(e.body)} bytes) -> "
            + (
                json.dumps({k: v for k, v in e.headers.items() if "streamfence" in k})
                if e.headers is not None
                else "no response yet"
            )
            for e in self.exchanges
        )

    def sources(self) -> list[str]:
        """x-streamfence-source of each started response, in order of arrival."""
        return [(e.headers or {}).get("x-streamfence-source", "?") for e in self.started()]


@dataclass
class AgentProxy:
    url: str
    watched: Watched


@asynccontextmanager
async def agent_proxy(upstream_url: str, **overrides: Any) -> AsyncIterator[AgentProxy]:
    """The proxy under real uvicorn on 127.0.0.1:0 (as tests/conftest.py's make_proxy),
    its app wrapped in `Watched`."""
    app = Watched(create_app(load(env={}, overrides={"upstream.url": upstream_url, **overrides})))
    async with serve(app) as (url, _server):
        yield AgentProxy(url, app)


async def supersede_stalled(
    proxy: AgentProxy,
    upstream: ScriptedUpstream,
    agent: Agent,
    is_turn: Callable[[Seen], bool],
    headers: dict[str, str],
    healthy: float,
    before_headers: bool = False,
) -> tuple[Seen, str, Finished]:
    """The agent's stream is held mid-answer (3 events) past `healthy` seconds; then this
    test, as another client with the agent's credential, sends the byte-identical request,
    which supersedes the stalled generation. Whatever the agent does next happens while the
    winner's stream is held; then every stream is let go. Returns the agent's first
    upstream request, the winner's whole SSE body, and how the agent ended.
    `before_headers`: the agent's request is held before its response headers instead
    (a Script with hold_headers), so that the agent is told with an HTTP 409."""
    first = await wait_for(upstream, is_turn)
    if not before_headers:
        await first.wait_sent(1)
        first.release(2)
        await first.wait_sent(3)
    await asyncio.sleep(healthy + 0.5)  # the condition under test: stalled that long
    url = f"{first.path}?{first.query}" if first.query else first.path
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
        async with client.stream("POST", url, content=first.body, headers=headers) as won:
            assert won.status_code == 200, await won.aread()
            reaction = proxy.watched.wait_started(3)
            await first_of(30, "the agent's reaction to the fence", reaction, agent.exit())
            for s in upstream.seen:  # the winner, and any further attempt
                s.release(100)
            body = (await won.aread()).decode()
    return first, body, await agent.finish()


async def first_of(limit: float, what: str, *aws: Awaitable[Any]) -> None:
    """Until the first of these completes (the others are cancelled), or fail after limit."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, _pending = await asyncio.wait(
            tasks, timeout=limit, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for t in tasks:
            t.cancel()
    if not done:
        raise AssertionError(f"not within {limit} s: {what}")
    for t in done:
        t.result()
