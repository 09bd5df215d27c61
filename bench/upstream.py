"""The benchmark's scripted upstream: raw asyncio + httptools, in its own process.

Every request streams OpenAI chat-completion chunks (chunked transfer encoding), shaped by
its headers so that the load client, not this process, decides the scenario:

    x-bench-tokens: N      token events before the stop chunk and [DONE]
    x-bench-delay-ms: D    pause between events (0: write as fast as flow control allows)
    x-bench-id: ID         names the request, for the close times below

When a connection goes away before its response is finished, the time (time.monotonic, one
clock for every process on the machine) is recorded under the request's id;
`GET /_bench/closes` returns them as JSON and clears them. B5 reads them to measure how
fast the proxy closes a superseded attempt's upstream.

Usage: python -m bench.upstream --port P   (prints "ready PORT" once listening)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from typing import cast

import httptools

from bench.loop import run_fast

CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"tok%d "},"finish_reason":null}]}\n\n'
)
STOP = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
)
DONE = b"data: [DONE]\n\n"
HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
HIGH_WATER = 256 * 1024


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Upstream(asyncio.Protocol):
    closes: dict[str, float] = {}

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.headers: dict[bytes, bytes] = {}
        self.url = b""
        self.task: asyncio.Task[None] | None = None
        self.current: str | None = None  # id of the response under way
        self.queue: list[tuple[bytes, dict[bytes, bytes]]] = []
        self.resume: asyncio.Future[None] | None = None
        self.lost = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.current is not None:
            Upstream.closes[self.current] = time.monotonic()
        if self.task is not None:
            self.task.cancel()
        if self.resume is not None and not self.resume.done():
            self.resume.set_result(None)

    def pause_writing(self) -> None:
        self.resume = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.resume is not None and not self.resume.done():
            self.resume.set_result(None)
        self.resume = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.headers = {}
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_message_complete(self) -> None:
        self.queue.append((self.url, self.headers))
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        try:
            while self.queue and not self.lost:
                url, headers = self.queue.pop(0)
                await self._respond(url, headers)
        finally:
            self.task = None

    async def _respond(self, url: bytes, headers: dict[bytes, bytes]) -> None:
        t = self.transport
        assert t is not None
        if url.startswith(b"/_bench/closes"):
            body = json.dumps(Upstream.closes).encode()
            Upstream.closes = {}
            t.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )
            t.close()
            return
        tokens = int(headers.get(b"x-bench-tokens", b"3"))
        delay = int(headers.get(b"x-bench-delay-ms", b"0")) / 1000
        self.current = headers.get(b"x-bench-id", b"").decode() or None
        t.write(HEAD)
        for i in range(tokens):
            if i and delay:
                await asyncio.sleep(delay)
            t.write(_chunk(CHUNK % i))
            if self.resume is not None:
                await self.resume
            if self.lost:
                return
        t.write(_chunk(STOP) + _chunk(DONE) + b"0\r\n\r\n")
        self.current = None


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, "127.0.0.1", port, backlog=8192)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    try:
        run_fast(main(args.port))
    except KeyboardInterrupt:
        sys.exit(0)
