"""Work that runs beside a request: background tasks the process keeps, and coroutines
whose first step runs at once, not at the event loop's next iteration.

`run_now` exists for the end of every request: its subscriber leaves its generation (the
last one closes the upstream and releases the lease), shielded from a cancellation from
outside. Most of the time that needs no wait at all, and a task and a shield for it were a
visible share of a short request's instructions (python -m bench.instructions); only when it has to
wait does the rest become a task, which the caller then shields as before.

`start_eagerly` exists for the start of every request (proxy/server/eager.py).
"""

from __future__ import annotations

import asyncio
import asyncio.tasks
import contextvars
import functools
import types
from collections.abc import Callable, Coroutine, Generator, Iterable
from typing import Any

_background: set[asyncio.Task[None]] = set()

# asyncio's own bookkeeping of the current task (private: Python 3.11-3.13 have both), which a
# first step taken outside its task needs. Without them nothing here breaks: `start_eagerly`
# is simply not used (proxy/server/hooks.py checks, and serve falls back to uvicorn's own).
_enter_task: Callable[[asyncio.AbstractEventLoop, asyncio.Task[Any]], None] | None = getattr(
    asyncio.tasks, "_enter_task", None
)
_leave_task: Callable[[asyncio.AbstractEventLoop, asyncio.Task[Any]], None] | None = getattr(
    asyncio.tasks, "_leave_task", None
)


async def cancelled(tasks: Iterable[asyncio.Task[Any]], within: float = 5.0) -> bool:
    """Cancel `tasks` and wait until they have ended, asking again every tenth of a second:
    on Python 3.11 a cancellation can be lost inside a library, and the task then goes on
    waiting for ever. (`asyncio.wait_for` returns the inner result when it completes just as
    the cancellation lands, gh-86296; redis-py sends every command under it, so a registry
    closed while its subscriber connected hung the close.) What ended them is left on each
    task, read (as `gather(..., return_exceptions=True)` would, so that the loop does not
    report it as never retrieved). False when one is still running after `within` seconds:
    the caller goes on without it."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    deadline = asyncio.get_running_loop().time() + within
    while pending:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(0.1, left))
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()
    return not pending


def eager_steps() -> bool:
    """asyncio's bookkeeping that `start_eagerly` needs is there (proxy/server/hooks.py)."""
    return _enter_task is not None and _leave_task is not None


def spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """`coro` as a task the process keeps a reference to until it ends."""
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


def run_now(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Runs `coro` in the caller's step up to its first wait: None if it ended there, else
    the task (`spawn`) that runs the rest. Whatever it raises before it waits, it raises
    here.

    The first part runs in the caller's task and the rest in another: `coro` must not
    wait inside an `asyncio.timeout()` it entered before its first wait (that timeout
    belongs to the caller's task). Generation.detach waits on futures and events only."""
    started = _Started(coro)
    started.taken = True
    try:
        started.waiting = coro.send(None)
    except StopIteration:
        return None
    return spawn(_prestepped(started))


def start_eagerly(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], context: contextvars.Context
) -> tuple[asyncio.Task[Any], Callable[[], None]]:
    """A task for `coro`, and its first step, for the caller to take before the loop runs
    again: as `asyncio.Task(..., eager_start=True)` (Python 3.12) does, on 3.11 too. The
    step runs with the task as the current task and in its context, so timeouts and task
    groups entered in it are the task's; the task, when it runs, waits for what the step
    waited for and goes on from there (proxy/server/eager.py: a request's first step). Take the
    step outside any task, from a loop callback: no other task may be current in it."""
    started = _Started(coro)
    task = loop.create_task(_prestepped(started), context=context)
    return task, functools.partial(context.run, started.first_step, loop, task)


def _prestepped(started: _Started) -> Coroutine[Any, Any, Any]:
    """What a task runs to finish `started`, stepped once to its first yield before it is
    a task's: a cancellation of the task before its first step is thrown in there and
    handed on to the coroutine (not left to the collector)."""
    rest = _task(started)
    rest.send(None)
    return rest


async def _task(started: _Started) -> Any:
    # A native coroutine around the generator: asyncio takes no generator as a task's
    # coroutine since Python 3.12, but any coroutine may await one made by types.coroutine.
    return await _finish(started)


@types.coroutine
def _finish(started: _Started) -> Generator[Any, Any, Any]:
    """Waits for what the coroutine's first step waits for (or throws in what cancelled
    the task), then drives the coroutine with `yield from`: from there on each resumption
    is passed on in C, with no Python of ours to run.

    No exception is left in a local when one leaves this frame: its traceback holds the
    frame, and the frame holding it back would be a cycle, the coroutine's objects left
    to the garbage collector (tests/turn/test_garbage.py)."""
    thrown: BaseException | None = None
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - a cancellation, for the coroutine
        thrown = exc
    coro = started.coro
    if not started.taken:  # the task ran before its first step was taken: a task as any
        started.taken = True
        if thrown is None:
            return (yield from coro)  # a coroutine's: allowed in a types.coroutine
        coro.close()
        try:
            raise thrown
        finally:
            thrown = None
    if started.ended is not None:  # the first step ended it: its value or its error
        raised, result = started.ended
        started.ended = None
        if thrown is None and not raised:
            return result
        try:
            raise result if thrown is None else thrown
        finally:
            thrown = result = None
    value, started.waiting = started.waiting, None
    while True:
        if thrown is not None:
            try:
                value = coro.throw(thrown)
            except StopIteration as stop:
                return stop.value
            finally:
                thrown = None
        try:
            yield value  # the task waits on it, as it would have for the coroutine
        except BaseException as exc:  # noqa: BLE001 - a cancellation, for the coroutine
            thrown = exc
        else:
            return (yield from coro)


class _Started:
    """A coroutine whose first step runs outside a task, and what that step left."""

    __slots__ = ("coro", "waiting", "ended", "taken")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.waiting: Any = None  # what its first step yielded: a future, or None
        self.ended: tuple[bool, Any] | None = None  # (raised, value): the first step ended it
        self.taken = False  # the first step: by the caller, or by the task if it ran first

    def first_step(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        if self.taken:
            return
        self.taken = True
        assert _enter_task is not None and _leave_task is not None  # proxy/server/hooks.py
        _enter_task(loop, task)
        try:
            self.waiting = self.coro.send(None)
        except StopIteration as stop:
            self.ended = (False, stop.value)
        except BaseException as exc:  # noqa: BLE001 - the task raises it, as a task would
            self.ended = (True, exc)
        finally:
            _leave_task(loop, task)
