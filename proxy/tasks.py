"""Work that runs beside a request: background tasks the process keeps, and a coroutine
run at once for as long as it does not have to wait.

`run_now` exists for the end of every request: its subscriber leaves its generation (the
last one closes the upstream and releases the lease), shielded from a cancellation from
outside. Most of the time that needs no wait at all, and a task and a shield for it were
3 % of a short request's instructions (python -m bench.instructions); only when it has to
wait does the rest become a task, which the caller then shields as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

_background: set[asyncio.Task[None]] = set()


def spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """`coro` as a task the process keeps a reference to until it ends."""
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


def run_now(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Runs `coro` in the caller's step up to its first wait: None if it ended there, else
    the task (`spawn`) that runs the rest. Whatever it raises before it waits, it raises
    here. (A cancellation of that task before its first step, which only the loop's own
    teardown would send, leaves the coroutine to the collector, which closes it.)

    The first part runs in the caller's task and the rest in another: `coro` must not
    wait inside an `asyncio.timeout()` it entered before its first wait (that timeout
    belongs to the caller's task). Generation.detach waits on futures and events only."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return spawn(_rest(_Started(coro, waiting)))


async def _rest(started: _Started) -> None:
    await started


class _Started:
    """A coroutine that has run up to a wait, as an awaitable for a task to finish: what
    the task sends or throws in goes on to the coroutine, what it yields comes back out."""

    __slots__ = ("_coro", "_waiting")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting: Any) -> None:
        self._coro = coro
        self._waiting = waiting

    def __await__(self) -> Generator[Any, Any, None]:
        coro, value = self._coro, self._waiting
        self._waiting = None
        while True:
            try:
                sent = yield value
            except BaseException as exc:  # noqa: BLE001 - a cancellation, thrown in by the task
                try:
                    value = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    value = coro.send(sent)
                except StopIteration:
                    return
