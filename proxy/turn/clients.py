"""The clients of one generation (proxy/turn/generation.py): its subscribers, in the order
they came, and those among them that wait, caught up, for its next event. The generation's
reader wakes them, or writes for the only one itself."""

from __future__ import annotations

import asyncio
from typing import Protocol


class Watcher(Protocol):
    """A subscriber (proxy/turn/relay.py), as its generation sees it."""

    cursor: int  # the number of the last event it has written
    parked: bool  # waiting for the next event, caught up with the buffer

    def superseded(self) -> None: ...

    async def write_inline(self, events: list[bytes], last: bool = False) -> None: ...


class Clients:
    __slots__ = ("_loop", "all", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop  # kept: on 3.11 asyncio.get_running_loop() is a getpid() each
        self.all: dict[Watcher, None] = {}  # the subscribers, in order
        self.waiting: list[asyncio.Future[None]] = []  # those caught up with the buffer

    def next(self) -> asyncio.Future[None]:
        """What a caught-up subscriber awaits: done at the generation's next event or end."""
        waiter = self._loop.create_future()
        self.waiting.append(waiter)
        return waiter

    def wake(self) -> None:
        # One future per waiting subscriber, resolved once: cheaper than an Event's
        # set/clear/wait on the path every relayed event takes.
        waiting, self.waiting = self.waiting, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    def slowest(self, default: int) -> int:
        """The lowest cursor among the subscribers: what every one of them has written."""
        return min((w.cursor for w in self.all), default=default)
