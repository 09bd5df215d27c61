"""proxy/tasks.py: a coroutine run at once up to its first wait, the rest in a task."""

from __future__ import annotations

import asyncio
import contextlib

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
