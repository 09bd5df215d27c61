"""A TCP hop a test can cut (a network partition between one proxy and Redis) or slow
down (`delay`: each chunk arrives that much later, in order, as over a long link).

`lose_reply_to(marker)`: the next request containing `marker` goes through, and its
connection is closed before the reply comes back: the command ran, its caller cannot know.

While the link is cut, bytes are held, not refused: a partition looks like silence to both
ends (no RST, no FIN), so each side finds out only through its own timeouts, as on a real
network. When the link heals, what was held goes through (TCP retransmits), and a
connection either end gave up on meanwhile is closed by it in the ordinary way.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType


class Link:
    def __init__(self, target_port: int, delay: float = 0.0) -> None:
        self.target_port = target_port
        self.delay = delay
        self.port = 0
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._lose: bytes | None = None
        self.lost = 0  # replies lost so far

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def lose_reply_to(self, marker: bytes) -> None:
        assert not self.delay, "a delayed link does not lose replies"
        self._lose = marker

    async def __aenter__(self) -> Link:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._pipes:
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        await self._open.wait()  # a connect during the cut hangs, as a SYN nobody answers
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.add(up_writer)
        doomed = asyncio.Event()  # a request on this connection is to lose its reply
        pipes = (self._pipe(reader, up_writer, doomed), self._pipe(up_reader, writer, doomed))
        for pipe in pipes:
            task = asyncio.create_task(pipe)
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, doomed: asyncio.Event
    ) -> None:
        if self.delay:
            await self._delayed(src, dst)
            return
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                await self._open.wait()
                if doomed.is_set():  # the reply: lost, with its connection
                    self.lost += 1
                    break
                if self._lose is not None and self._lose in data:
                    self._lose = None
                    doomed.set()
                dst.write(data)
                await dst.drain()
        dst.close()

    async def _delayed(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Latency, not a bandwidth cap: every chunk is due `delay` after it was read."""
        loop = asyncio.get_running_loop()
        due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, data = await due.get()
                if not data:
                    break
                await asyncio.sleep(at - loop.time())  # the link's latency itself
                dst.write(data)
                await dst.drain()

        sender = asyncio.create_task(deliver())
        try:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    due.put_nowait((loop.time() + self.delay, data))
            due.put_nowait((0.0, b""))
            with contextlib.suppress(OSError):
                await sender
        finally:
            sender.cancel()
            dst.close()
