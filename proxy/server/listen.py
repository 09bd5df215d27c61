"""The listening socket's accept loop: every pending connection at each wake-up.

libuv (and so uvloop) accepts one connection per event-loop iteration since 1.45 ("unix:
don't accept() connections in a loop", libuv#3696): it counts on level-triggered polling to
wake it again for the next one. That is cheap on an idle server, but the next iteration comes
only after everything else that was ready has run. Under load (bench B5, docs/performance.md)
the loop is busy relaying for milliseconds an iteration, fewer connections were admitted than
arrived, the listening socket's queue grew to hundreds, and a supersede waited seconds in the
kernel before the proxy saw it, where its own fence takes a fraction of a millisecond.
asyncio's own loop accepts up to the backlog at each wake-up; this does the same on uvloop.

`Loop` is the loop uvicorn is told to use (`loop="proxy.server.listen:Loop"`, a custom loop
factory): uvloop's loop, whose `create_server` on an already-bound socket accepts here and
hands each connection to uvloop's own transport (`connect_accepted_socket`). Everything else
is uvloop's.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from proxy.server import hooks

log = logging.getLogger("streamfence")

# Out of descriptors or memory: the socket stays readable and accepting again at once would
# spin. asyncio waits this long before it tries again (asyncio.constants.ACCEPT_RETRY_DELAY).
RETRY_DELAY = 1.0
_SHORT_OF = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class Listener:
    """Accepts on one listening socket: what uvicorn needs of an `asyncio.Server`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        factory: ProtocolFactory,
        backlog: int,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._factory = factory
        # A wake-up takes at most this many, as asyncio does, so that a flood of connections
        # cannot starve the streams already relaying.
        self._batch = max(1, backlog)
        self._serving = False
        self._retry: asyncio.TimerHandle | None = None
        # socket.accept(), less its two enum conversions (see _accepted_class): a descriptor
        # from the C method, then a socket of the accepted class around it.
        self._accept_fd = sock._accept  # type: ignore[attr-defined]  # not in typeshed
        self._accepted = _accepted_class(sock)
        self._args = (int(sock.family), int(sock.type), sock.proto)
        sock.setblocking(False)
        sock.listen(self._batch)  # as asyncio's server does: the socket may only be bound
        self._start()

    def is_serving(self) -> bool:
        return self._serving

    def _start(self) -> None:
        self._retry = None
        self._serving = True
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(self._batch):
            try:
                fd, _ = self._accept_fd()
            except (BlockingIOError, InterruptedError):
                return  # nothing more pending: the next connection wakes us
            except ConnectionAbortedError:
                continue  # the client gave up while queued: the next one may be there
            except OSError as exc:
                if exc.errno not in _SHORT_OF:
                    raise  # the loop logs it; the reader stays, as asyncio's does
                log.warning("cannot accept connections for now (%s); retrying in 1 s", exc)
                self._loop.remove_reader(self._sock.fileno())
                self._serving = False
                self._retry = self._loop.call_later(RETRY_DELAY, self._start)
                return
            self._hand_over(self._accepted(*self._args, fd))

    def _hand_over(self, conn: socket.socket) -> None:
        # (Left blocking: uvloop's transport makes it non-blocking, libuv's uv_tcp_open.)
        try:
            protocol = self._factory()
        except Exception as exc:  # noqa: BLE001 - one connection's failure, not the server's
            conn.close()  # nothing owns it yet
            log.warning("could not set up an accepted connection: %r", exc)
            return
        setup = self._loop.connect_accepted_socket(lambda: protocol, conn)
        # Its first step runs here and now: it opens uvloop's transport and schedules the
        # protocol's connection_made, as uvloop's own accept does. A task would take it one
        # loop iteration later, tens of milliseconds under load. What is left of it is the
        # wait for that callback, resumed once it has run.
        self._step(setup)

    def _step(self, setup: Coroutine[Any, Any, Any]) -> None:
        try:
            waiting = setup.send(None)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - one connection's failure, not the server's
            # uvloop's transport owns the socket from its first step, and closes both.
            log.warning("could not set up an accepted connection: %r", exc)
            return
        if isinstance(waiting, asyncio.Future):
            waiting.add_done_callback(lambda _: self._step(setup))
        else:  # a bare yield: resume at the next iteration, as a task would
            self._loop.call_soon(self._step, setup)

    def close(self) -> None:
        """Stop accepting; the listening socket is its owner's to close (uvicorn's)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._serving:
            self._serving = False
            self._loop.remove_reader(self._sock.fileno())

    async def wait_closed(self) -> None:
        # Nothing to wait for: connections accepted here belong to no uvloop server, and
        # uvicorn waits for them itself (its server state).
        return


def _accepted_class(listening: socket.socket) -> type[socket.socket]:
    """The class of the sockets accepted on `listening`: its family and type as plain
    attributes. socket.socket turns each into an enum at every read, in Python, and
    socket.accept() and uvloop's connect_accepted_socket read both for every connection:
    a quarter of the instructions of setting one up (python -m bench.instructions)."""

    class Accepted(socket.socket):
        __slots__ = ()
        family = listening.family
        type = listening.type

    return Accepted


class Loop(uvloop.Loop):
    """uvloop's loop; a server on an already-bound socket (how serve.py runs uvicorn)
    accepts every pending connection at each wake-up."""

    async def create_server(
        self, protocol_factory: ProtocolFactory, *args: Any, **kwargs: Any
    ) -> Any:
        sock = kwargs.get("sock")
        plain = not args and kwargs.get("ssl") is None and set(kwargs) <= {"sock", "ssl", "backlog"}
        if sock is None or not plain or hooks.accept_missing() is not None:
            return await super().create_server(protocol_factory, *args, **kwargs)
        return Listener(self, sock, protocol_factory, kwargs.get("backlog", 100))
