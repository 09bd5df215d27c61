"""The accept loop (proxy/server/listen.py) on a real uvloop loop and real loopback sockets.

libuv accepts one connection per loop iteration; under load that left connections queued in
the kernel for seconds (bench B5). Each test here counts loop iterations, not time."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
import uvloop

from proxy.config.load import load
from proxy.server import listen, serve


class Counting(asyncio.Protocol):
    made: list[asyncio.BaseTransport]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(transport)


def run(loop_factory: Callable[[], asyncio.AbstractEventLoop], main: Awaitable[Any]) -> Any:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main)  # type: ignore[arg-type]


@contextmanager
def listening(backlog: int = 2048) -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    try:
        yield sock
    finally:
        sock.close()


def queue_connections(sock: socket.socket, n: int) -> list[socket.socket]:
    """n connections completed by the kernel and waiting in the listening socket's queue
    (a blocking connect returns once the handshake is done)."""
    return [socket.create_connection(sock.getsockname()) for _ in range(n)]


async def iterations_until_accepted(
    sock: socket.socket, n: int, backlog: int = 2048, limit: int = 1000
) -> int:
    made: list[asyncio.BaseTransport] = []
    protocol = type("P", (Counting,), {"made": made})
    loop = asyncio.get_running_loop()
    server = await loop.create_server(protocol, sock=sock, backlog=backlog)
    turns = 0
    while len(made) < n and turns < limit:
        await asyncio.sleep(0)  # noqa: ASYNC110 - one loop iteration: iterations are the measure
        turns += 1
    assert len(made) == n
    for transport in made:
        transport.close()
    server.close()
    await server.wait_closed()
    return turns


@pytest.mark.parametrize(
    ("loop_factory", "accepts_all"), [(listen.Loop, True), (uvloop.Loop, False)]
)
def test_every_pending_connection_is_accepted_at_one_wake_up(
    loop_factory: Callable[[], asyncio.AbstractEventLoop], accepts_all: bool
) -> None:
    # uvloop's own server is the control: one accept per iteration, 200 iterations.
    with listening() as sock:
        clients = queue_connections(sock, 200)
        turns = run(loop_factory, iterations_until_accepted(sock, 200))
        for c in clients:
            c.close()
    assert (turns <= 5) is accepts_all, turns


def test_a_connection_is_made_as_soon_as_with_uvloops_own_accept() -> None:
    # The hand-over to uvloop's transport runs in the accept itself, not in a task of its
    # own: a task would add one loop iteration to every connection, tens of ms under load.
    def turns(loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> int:
        with listening() as sock:
            (client,) = queue_connections(sock, 1)
            try:
                return int(run(loop_factory, iterations_until_accepted(sock, 1)))
            finally:
                client.close()

    assert turns(listen.Loop) <= turns(uvloop.Loop)


def test_one_wake_up_takes_at_most_the_backlog() -> None:
    # A flood of connections cannot hold the loop in accept() for ever: like asyncio, at
    # most `backlog` per wake-up, the rest at the next ones.
    with listening() as sock:
        clients = queue_connections(sock, 60)
        turns = run(listen.Loop, iterations_until_accepted(sock, 60, backlog=10))
        for c in clients:
            c.close()
    assert turns >= 6


def test_out_of_descriptors_pauses_accepting_then_resumes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(listen, "RETRY_DELAY", 0.01)
    failures = [OSError(errno.EMFILE, "Too many open files")]
    failed: list[asyncio.Event] = []

    class Scarce(socket.socket):
        def _accept(self) -> tuple[int, Any]:
            if failures:
                failed[0].set()
                raise failures.pop()
            return super()._accept()

    async def main(sock: Scarce) -> bool:
        loop = asyncio.get_running_loop()
        made: asyncio.Future[None] = loop.create_future()

        class Once(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                transport.close()
                made.set_result(None)

        failed.append(asyncio.Event())
        server = listen.Listener(loop, sock, Once, 100)
        (client,) = queue_connections(sock, 1)
        await failed[0].wait()  # the reader ran once, and failed
        paused = not server.is_serving()
        await made  # accepted after the retry delay, with nothing else to wake the loop
        client.close()
        server.close()
        await server.wait_closed()
        return paused

    sock = Scarce()
    sock.bind(("127.0.0.1", 0))
    sock.listen(100)
    with caplog.at_level(logging.WARNING, "streamfence"):
        paused = run(listen.Loop, main(sock))
    sock.close()
    assert paused  # the reader was removed: a still-readable socket does not spin the loop
    assert "cannot accept connections for now" in caplog.text


def test_a_protocol_that_cannot_be_made_costs_only_its_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main(sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        made: asyncio.Future[asyncio.BaseTransport] = loop.create_future()
        calls: list[None] = []

        class Second(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                made.set_result(transport)

        def factory() -> asyncio.BaseProtocol:
            calls.append(None)
            if len(calls) == 1:
                raise RuntimeError("no protocol for you")
            return Second()

        server = await loop.create_server(factory, sock=sock, backlog=100)
        (await made).close()  # the next connection is served
        server.close()
        await server.wait_closed()

    with listening() as sock, caplog.at_level(logging.WARNING, "streamfence"):
        first, second = queue_connections(sock, 2)
        run(listen.Loop, main(sock))
        first.settimeout(5)
        assert first.recv(1) == b""  # closed by the proxy, not left open (or leaked)
        first.close()
        second.close()
    assert "could not set up an accepted connection" in caplog.text


def test_a_bound_socket_that_is_not_listening_yet_is_served() -> None:
    # asyncio's and uvloop's servers call listen() themselves: a socket that is only bound
    # (as tests/scripted.py hands uvicorn) must not make accept() fail on every wake-up.
    async def main(sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        made: asyncio.Future[asyncio.BaseTransport] = loop.create_future()

        class Once(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                made.set_result(transport)

        server = await loop.create_server(Once, sock=sock, backlog=100)
        client = await loop.run_in_executor(None, socket.create_connection, sock.getsockname())
        (await made).close()
        client.close()
        server.close()
        await server.wait_closed()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        run(listen.Loop, main(sock))
    finally:
        sock.close()


def test_closed_listener_accepts_nothing_more() -> None:
    async def main(sock: socket.socket) -> bool:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, sock=sock, backlog=100)
        server.close()
        await server.wait_closed()
        # Nothing is watching the socket any more: removing a reader finds none.
        return bool(loop.remove_reader(sock.fileno()))

    with listening() as sock:
        assert run(listen.Loop, main(sock)) is False


def test_other_servers_are_uvloops_own() -> None:
    async def main() -> str:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        server.close()
        await server.wait_closed()
        return type(server).__module__

    assert run(listen.Loop, main()).startswith("uvloop")


def test_the_proxy_runs_uvicorn_on_this_loop() -> None:
    config = load(env={}, overrides={"upstream.url": "http://127.0.0.1:9"})
    options = serve.uvicorn_options(config)
    assert uvicorn.Config(None, **options).get_loop_factory() is listen.Loop
