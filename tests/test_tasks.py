"""proxy/tasks.py: a coroutine run at once up to its first wait, the rest in a task."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import sys
from typing import Any

import pytest

from proxy import tasks


async def test_a_coroutine_that_never_waits_ends_in_the_callers_step() -> None:
    done: list[str] = []

    async def quick() -> None:
        done.append("ran")

    assert tasks.run_now(quick()) is None
    assert done == ["ran"]  # before the caller awaited anything
    assert not tasks._background


async def test_what_follows_a_wait_runs_in_a_task_with_what_it_waited_for() -> None:
    gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    async def slow() -> None:
        seen.append("before")
        seen.append(await gate)

    rest = tasks.run_now(slow())
    assert rest is not None and seen == ["before"]
    assert rest in tasks._background  # kept until it ends
    gate.set_result("after")
    await asyncio.wait_for(rest, 5)
    assert seen == ["before", "after"]
    assert rest not in tasks._background


async def test_an_error_before_the_wait_is_raised_to_the_caller_and_after_it_by_the_task() -> None:
    async def early() -> None:
        raise ValueError("early")

    with pytest.raises(ValueError, match="early"):
        tasks.run_now(early())

    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def late() -> None:
        await gate
        raise ValueError("late")

    rest = tasks.run_now(late())
    assert rest is not None
    gate.set_result(None)
    with pytest.raises(ValueError, match="late"):
        await asyncio.wait_for(rest, 5)


async def test_shielded_the_rest_outlives_a_cancelled_caller_and_its_own_cancel_reaches_it() -> (
    None
):
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ends: list[str] = []

    async def closing() -> None:
        try:
            await gate
            ends.append("finished")
        except asyncio.CancelledError:
            ends.append("cancelled")
            raise

    async def caller() -> None:
        rest = tasks.run_now(closing())
        assert rest is not None
        await asyncio.shield(rest)

    outer = asyncio.ensure_future(caller())
    await asyncio.sleep(0)  # the caller waits in its shield now
    outer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await outer
    (rest,) = tasks._background
    gate.set_result(None)  # the shielded rest was not cancelled with its caller
    await asyncio.wait_for(rest, 5)
    assert ends == ["finished"]

    second: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    gate = second
    other = tasks.run_now(closing())
    assert other is not None
    await asyncio.sleep(0)  # the task has taken over the wait
    other.cancel()  # a cancellation of the task itself is thrown into the coroutine
    with pytest.raises(asyncio.CancelledError):
        await other
    assert ends == ["finished", "cancelled"]


# -- start_eagerly: a task whose first step the caller takes (proxy/server/eager.py) -----------


async def _eagerly(
    coro: Any, seen: list[Any] | None = None, *, cancel: bool = False
) -> asyncio.Task[Any]:
    """`coro`'s task made and its first step taken in a loop callback, outside any task,
    as uvicorn's data_received does; `seen` gets a marker between the two. With `cancel`
    the task is cancelled in that callback too, before the loop has run it at all."""
    loop = asyncio.get_running_loop()
    made: asyncio.Future[asyncio.Task[Any]] = loop.create_future()

    def callback() -> None:
        task, step = tasks.start_eagerly(loop, coro, contextvars.copy_context())
        if seen is not None:
            seen.append("made")
        step()
        if cancel:
            task.cancel()
        made.set_result(task)

    loop.call_soon(callback)
    return await made


async def test_the_first_step_runs_when_taken_as_the_task_and_the_task_goes_on_from_it() -> None:
    gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    seen: list[Any] = []
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def request() -> str:
        seen.append(asyncio.current_task())
        var.set("set in the first step")
        seen.append(await gate)
        seen.append(var.get())  # the same context in the task
        return "answer"

    task = await _eagerly(request(), seen)
    assert seen == ["made", task]  # the step ran when taken, as the task, up to its wait
    gate.set_result("after")
    assert await asyncio.wait_for(task, 5) == "answer"
    assert seen == ["made", task, "after", "set in the first step"]
    assert var.get() == "unset"  # the caller's context is not the task's


async def test_a_step_not_taken_before_the_task_runs_is_the_tasks_own_first_step() -> None:
    ran: list[str] = []

    async def request() -> str:
        ran.append("ran")
        await asyncio.sleep(0)
        return "answer"

    task, step = tasks.start_eagerly(
        asyncio.get_running_loop(), request(), contextvars.copy_context()
    )
    assert await asyncio.wait_for(task, 5) == "answer"
    step()  # too late: the task took it; nothing runs twice
    assert ran == ["ran"]


async def test_a_first_step_that_ends_the_coroutine_or_raises_ends_the_task_so() -> None:
    async def quick() -> str:
        return "done"

    async def failing() -> None:
        raise ValueError("in the first step")

    assert await asyncio.wait_for(await _eagerly(quick()), 5) == "done"
    with pytest.raises(ValueError, match="in the first step"):
        await asyncio.wait_for(await _eagerly(failing()), 5)


async def test_a_timeout_entered_in_the_first_step_is_the_tasks() -> None:
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    outcome: list[str] = []

    async def bounded() -> None:
        try:
            async with asyncio.timeout(0.01):  # needs the current task: the eager one
                await never
        except TimeoutError:
            outcome.append("timed out")

    await asyncio.wait_for(await _eagerly(bounded()), 5)
    assert outcome == ["timed out"]


@pytest.mark.parametrize("waits_on", ["future", "bare yield"])
async def test_a_cancellation_before_the_task_first_runs_reaches_the_coroutine(
    waits_on: str,
) -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ends: list[str] = []

    async def request() -> None:
        try:
            if waits_on == "bare yield":
                await asyncio.sleep(0)
            await gate
            ends.append("finished")
        except asyncio.CancelledError:
            ends.append("cancelled where it waited")
            raise

    task = await _eagerly(request(), cancel=True)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert ends == ["cancelled where it waited"]


async def test_a_cancellation_while_the_task_waits_is_the_coroutines_to_handle() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ends: list[str] = []

    async def stubborn() -> str:
        try:
            await gate
        except asyncio.CancelledError:
            ends.append("cancelled")
        return "kept going"

    task = await _eagerly(stubborn())
    await asyncio.sleep(0)  # the task runs and takes over the wait
    task.cancel()
    assert await asyncio.wait_for(task, 5) == "kept going"
    assert ends == ["cancelled"]


async def _swallowing_a_cancellation(inner: asyncio.Future[None]) -> None:
    """What a redis-py command does on Python 3.11: a send under asyncio.wait_for, whose
    result arrives in the same loop iteration as a cancellation (then wait_for returns the
    result and the cancellation is lost, gh-86296), and then a long wait."""
    await asyncio.wait_for(inner, 10)
    await asyncio.Event().wait()


async def test_cancelled_ends_a_task_that_lost_its_first_cancellation() -> None:
    # A registry closed while its subscriber connected hung its close for ever (CI).
    loop = asyncio.get_running_loop()
    inner: asyncio.Future[None] = loop.create_future()
    task = loop.create_task(_swallowing_a_cancellation(inner))
    await asyncio.sleep(0)  # in wait_for
    inner.set_result(None)
    task.cancel()  # in the same iteration as the result
    _, pending = await asyncio.wait([task], timeout=0.3)
    if sys.version_info < (3, 12):  # 3.12's wait_for keeps the cancellation
        assert pending == {task}, "the cancellation was not lost: the hazard is gone"
    assert await tasks.cancelled([task], within=2)
    assert task.cancelled()


async def test_cancelled_gives_up_on_a_task_that_will_not_end() -> None:
    stop = asyncio.Event()

    async def stubborn() -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await stop.wait()

    task = asyncio.get_running_loop().create_task(stubborn())
    await asyncio.sleep(0)
    assert not await tasks.cancelled([task], within=0.3)  # bounded: the caller goes on
    assert not task.done()
    stop.set()
    await task


async def test_cancelled_reads_what_ended_each_task() -> None:
    # Like gather(..., return_exceptions=True), which it replaced: a task that failed while
    # the others were being cancelled is not reported by the loop as never retrieved.
    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:

        async def fails() -> None:
            raise ConnectionError("gone")

        task = loop.create_task(fails())
        await asyncio.sleep(0)
        assert await tasks.cancelled([task])
        assert task.done() and not task.cancelled()
        del task  # (its exception is not read here: that would mark it retrieved)
        gc.collect()
        assert reported == []
    finally:
        loop.set_exception_handler(None)
