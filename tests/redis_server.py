"""A real `redis-server` for tests: a free loopback port, a temp dir, no persistence.

`RedisServer.start()` returns once the server logs that it accepts connections (an event,
not a sleep); `kill()` sends SIGKILL, like a crash; `start()` again brings it back on the
same port, empty, as a restarted Redis without persistence would be.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tests.upstream import free_port

REDIS_SERVER = shutil.which("redis-server")
READY_LINE = "Ready to accept connections"


class RedisServer:
    def __init__(self, workdir: str, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        assert REDIS_SERVER is not None, "redis-server is not installed"
        assert self.proc is None, "already running"
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self.workdir,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--loglevel", "notice",
        ]  # fmt: skip
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self.proc = proc
        ready = threading.Event()
        lines: list[str] = []

        def drain() -> None:
            # Reads the server's log to its end, so it never blocks on a full pipe.
            assert proc.stdout is not None
            for line in proc.stdout:
                if len(lines) < 200:
                    lines.append(line)
                if READY_LINE in line:
                    ready.set()
            proc.stdout.close()
            ready.set()  # exited: start() reports it

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout) or proc.poll() is not None:
            self.stop()
            raise RuntimeError("redis-server did not become ready:\n" + "".join(lines))

    async def astart(self) -> None:
        """`start()` without blocking the event loop that runs the proxies under test."""
        await asyncio.to_thread(self.start)

    def kill(self) -> None:
        """SIGKILL: the server vanishes without a goodbye, as in a crash."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@contextmanager
def running_redis() -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="streamfence-redis-") as workdir:
        server = RedisServer(workdir)
        server.start()
        try:
            yield server
        finally:
            server.stop()
