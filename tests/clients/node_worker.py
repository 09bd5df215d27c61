"""The Node client libraries (tests/clients/node/) driven from pytest: one `node call.mjs
--serve` process for the whole session reads calls as JSON lines and prints what each
library surfaced. Threads, not asyncio, own the pipe: every test has its own event loop,
the process outlives them all.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import IO, Any

from tests.clients.pyclients import Call, Outcome

NODE_DIR = Path(__file__).resolve().parent / "node"
NODE = shutil.which("node")

NODE_CLIENTS = (
    "node-openai-chat",
    "node-openai-responses",
    "node-anthropic",
    "node-google-genai",
    "node-ai-sdk-openai-chat",
    "node-ai-sdk-openai-responses",
    "node-ai-sdk-anthropic",
)


def node_missing() -> str | None:
    """Why the Node clients cannot run here, or None. (CI fails instead of skipping: a
    missing `npm ci` must not pass as green.)"""
    if NODE is None:
        return "node is not installed"
    if not (NODE_DIR / "node_modules").is_dir():
        return f"run `npm ci` in {NODE_DIR}"
    return None


class NodeWorker:
    def __init__(self) -> None:
        assert NODE is not None
        self.proc = subprocess.Popen(
            [NODE, "call.mjs", "--serve"],
            cwd=NODE_DIR,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, Call, asyncio.Future[Any]]] = {}
        self.stderr: list[str] = []
        ready = self.proc.stdout.readline()
        if json.loads(ready or "{}").get("ready") is not True:
            raise RuntimeError(f"node worker did not start: {ready!r} {self.proc.stderr.read()}")
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True),
            threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            self.stderr.append(line)

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            msg = json.loads(line)
            with self._lock:
                entry = self._pending.get(msg["id"])
                if entry is not None and "first" not in msg:
                    del self._pending[msg["id"]]
            if entry is None:
                continue
            loop, call, future = entry
            if msg.get("first"):
                loop.call_soon_threadsafe(call.first.set)
            else:
                loop.call_soon_threadsafe(_resolve, future, msg)

    async def call(self, client: str, call: Call) -> Outcome:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        ident = next(self._ids)
        with self._lock:
            self._pending[ident] = (loop, call, future)
        line = {
            "id": ident,
            "client": client,
            "base": call.base,
            "prompt": call.prompt,
            "stream": call.stream,
            "turn": call.turn,
            "headers": call.headers,
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(line) + "\n")
        self.proc.stdin.flush()
        try:
            msg = await asyncio.wait_for(future, 30)
        except TimeoutError:
            stderr = "".join(self.stderr)
            raise AssertionError(f"{client} never answered; stderr: {stderr}") from None
        return Outcome(
            text=msg["text"] or "", error=msg["error"], message=msg["message"], status=msg["status"]
        )

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for thread in self._threads:  # they end at the pipes' end of file
            thread.join(5)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()


def _resolve(future: asyncio.Future[Any], msg: Any) -> None:
    if not future.done():
        future.set_result(msg)
