"""Every test ends within its bound, teardown included; a hung one fails with where it waited.

The bound is pytest-timeout's `timeout` (pyproject.toml, or `@pytest.mark.timeout(N)`): the
whole test, its fixtures' setup and teardown included. Why pytest-timeout alone let a test
hang for six minutes (issue 31): its signal method fires once, raising `Failed` wherever the
main thread happens to be. On an event loop that is either inside a task's step, where
asyncio keeps it as that task's exception (the test goes on waiting), or in `select()`, out
of `run_until_complete`: the test fails, but the tasks it left are still waiting, and anyio's
runner then closes its loop with asyncio's `Runner.close()`, which cancels every task once
and waits for all of them without a bound. A test that swallows a cancellation
(`with pytest.raises(CancelledError): await task` swallows the runner's own) leaves anyio's
runner task waiting for its next test forever, with the alarm spent.

So, three layers, each under the one bound:
1. In the loop: each async step of a test (the test itself, each async fixture's setup and
   teardown) runs under a watchdog. At the test's soft deadline (SOFT_SHARE of its bound) it
   writes where every task waits, cancels the step (again every RECANCEL_EVERY seconds while
   the step swallows it) and fails the test with that dump. The suite goes on.
2. The loop's end: leftover tasks are cancelled until they end, for SETTLE seconds at most
   (in place of asyncio's single cancellation and unbounded wait); a task that outlives that
   is dropped from the loop's books, and the test fails at teardown with its stack.
3. The process: at the bound itself, a thread (pytest-timeout's timer hooks, taken over
   here: its `timeout_method` is not used). It covers what the loop cannot see: a blocked
   loop, a sync test, a wait in another thread. It writes every thread's stack and every
   task's await chain to the process's stderr, with the test's captured output, and ends the
   process. Under pytest-xdist (CI: -n 4) that stderr is the controller's own, so the dump
   is in the log; the worker is replaced and the test reported as crashed ("worker 'gw0'
   crashed while running ..."), and the run goes on.
"""

from __future__ import annotations

import asyncio
import asyncio.runners
import functools
import inspect
import io
import os
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import pytest_timeout

T = TypeVar("T")

SOFT_SHARE = 0.8  # of a test's bound: the rest is left for the dump, the cancel, teardown
TEARDOWN_STEP = 10.0  # seconds any one async teardown step may take, even past the deadline
RECANCEL_EVERY = 1.0  # a step that swallowed its cancellation is cancelled again
SETTLE = 5.0  # seconds the loop's leftover tasks get to end once cancelled


@dataclass
class _Bound:
    """The test running now (one at a time per process, xdist worker included)."""

    nodeid: str
    hard: float  # its bound, in seconds
    started: float  # time.monotonic()

    @property
    def soft(self) -> float:
        return self.started + self.hard * SOFT_SHARE

    @property
    def end(self) -> float:
        return self.started + self.hard

    def step_deadline(self, teardown: bool) -> float:
        if not teardown:
            return self.soft
        now = time.monotonic()
        # A teardown step after a fired watchdog still gets its seconds, inside the bound.
        return min(max(self.soft, now + TEARDOWN_STEP), self.end - 1.0)


_current: _Bound | None = None
_loop: asyncio.AbstractEventLoop | None = None  # the loop of the last step watched
_left_over: list[str] = []  # reports of tasks that outlived SETTLE, for the test's teardown
_timer = pytest.StashKey[threading.Timer]()


# -- layer 1: a watchdog over each async step ------------------------------------------------
class _Watchdog:
    def __init__(self, deadline: float, what: str) -> None:
        global _loop
        self.loop = _loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.what = what
        self.report: str | None = None
        self.cancels = 0
        self.until = 0.0
        delay = max(0.0, deadline - time.monotonic())
        self.handle: asyncio.TimerHandle | None = self.loop.call_later(delay, self._fire)
        self.bound = delay

    def _fire(self) -> None:
        now = time.monotonic()
        if self.report is None:
            self.report = where_tasks_wait(self.loop)
            self.until = now + SETTLE
        if now < self.until:
            self.cancels += 1
            self.task.cancel(f"{self.what} overran its bound")
            self.handle = self.loop.call_later(RECANCEL_EVERY, self._fire)
        else:
            self.handle = None  # it swallows every cancellation: layer 3's to end

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        # Take back the cancellations this watchdog requested, so that nothing after it
        # (anyio's runner, the next step) sees the task as still being cancelled.
        for _ in range(min(self.cancels, self.task.cancelling())):
            self.task.uncancel()
        self.cancels = 0

    def failure(self, ended: BaseException | None) -> pytest.fail.Exception:
        bound = _current.hard if _current is not None else self.bound
        then = "" if ended is None else f", and then ended with {ended!r}"
        return pytest.fail.Exception(
            f"{self.what} did not end within its test's bound (timeout = {bound:g} s): it was "
            f"cancelled after {self.bound:.1f} s{then}. Where each task waited then:\n"
            f"{self.report}",
            pytrace=False,
        )


async def within(step: Awaitable[T], deadline: float, what: str) -> T:
    """`step`, in this task, failed with a dump of every task if it runs past `deadline`."""
    dog = _Watchdog(deadline, what)
    try:
        result = await step
    except BaseException as exc:
        dog.disarm()
        if dog.report is not None:
            raise dog.failure(exc) from exc
        raise
    dog.disarm()
    if dog.report is not None:  # it swallowed the cancellation and ended anyway
        raise dog.failure(None)
    return result


def where_tasks_wait(loop: asyncio.AbstractEventLoop | None) -> str:
    """Every task of `loop` with the chain of awaits it is suspended in, innermost last (a
    task's own get_stack() gives one frame only), and the stacks of other threads."""
    out = io.StringIO()
    tasks = asyncio.all_tasks(loop) if loop is not None and not loop.is_closed() else set()
    for task in sorted(tasks, key=lambda t: t.get_name()):
        frames, waits_on = _await_chain(task.get_coro())
        out.write(f"--- task {task.get_name()}, waiting on {waits_on!r:.200}\n")
        out.write("".join(traceback.StackSummary.extract(frames, limit=60).format()))
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, str(ident))
        if ident != me and not name.startswith("pytest_timeout"):
            stack = traceback.extract_stack(frame)
            # The test runner's own frames first (pytest, pluggy, xdist's execnet): not where.
            while len(stack) > 1 and any(part in stack[0].filename for part in _RUNNER):
                stack.pop(0)
            out.write(f"--- thread {name}\n")
            out.write("".join(stack.format()))
    return out.getvalue()


_RUNNER = ("/_pytest/", "/pluggy/", "/execnet/", "/xdist/", "<string>")


def _await_chain(coro: Any) -> tuple[list[tuple[Any, int]], Any]:
    """The frames of a suspended coroutine and of everything it awaits, and the innermost
    thing awaited (a future, usually)."""
    frames: list[tuple[Any, int]] = []
    for _ in range(200):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        frame = frame or getattr(coro, "ag_frame", None)
        if frame is not None:
            frames.append((frame, frame.f_lineno))
        inner = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        inner = inner or getattr(coro, "ag_await", None)
        if inner is None and frame is not None:
            # A coroutine driven by hand (proxy/tasks.py's run_now): its driver's `coro`.
            inner = frame.f_locals.get("coro")
            inner = inner if inspect.iscoroutine(inner) and inner.cr_frame is not None else None
        if inner is None:
            break
        coro = inner
    return frames, coro


def _step_deadline(teardown: bool) -> float | None:
    if _current is not None:
        return _current.step_deadline(teardown)
    # A wider-scoped fixture's teardown after the last test: a step's own seconds.
    return time.monotonic() + TEARDOWN_STEP if teardown else None


def _bounded_test(func: Callable[..., Awaitable[Any]], what: str) -> Callable[..., Any]:
    @functools.wraps(func)
    async def test(**kwargs: Any) -> Any:
        deadline = _step_deadline(teardown=False)
        if deadline is None:
            return await func(**kwargs)
        return await within(func(**kwargs), deadline, what)

    return test


def _bounded_fixture(func: Callable[..., Any], name: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(func):

        @functools.wraps(func)
        async def generator(**kwargs: Any) -> AsyncIterator[Any]:
            steps = func(**kwargs)
            deadline = _step_deadline(teardown=False)
            what = f"the setup of fixture {name!r}"
            first = steps.asend(None)
            yield await (first if deadline is None else within(first, deadline, what))
            what = f"the teardown of fixture {name!r}"
            try:
                await within(steps.asend(None), _step_deadline(teardown=True) or 0.0, what)
            except StopAsyncIteration:
                return
            raise RuntimeError(f"fixture {name!r} yielded twice")

        return generator

    @functools.wraps(func)
    async def coroutine(**kwargs: Any) -> Any:
        deadline = _step_deadline(teardown=False)
        step = func(**kwargs)
        return await (step if deadline is None else within(step, deadline, f"fixture {name!r}"))

    return coroutine


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    original = pyfuncitem.obj
    # anyio runs a coroutine test in its runner task (hypothesis ones through their inner
    # test, which is left to layer 3).
    wrap = inspect.iscoroutinefunction(original) and not hasattr(original, "hypothesis")
    if wrap:
        pyfuncitem.obj = _bounded_test(original, f"test {pyfuncitem.name}")
    try:
        return (yield)
    finally:
        if wrap:
            pyfuncitem.obj = original


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Generator[None, object, object]:
    # Outside anyio's own wrapper of this hook, which reads `fixturedef.func` as it starts:
    # it then runs the bounded function in its runner task, as it would the fixture.
    func = fixturedef.func
    wrap = (
        (inspect.isasyncgenfunction(func) or inspect.iscoroutinefunction(func))
        and not inspect.ismethod(func)
        and "anyio_backend" in request.fixturenames
    )
    if wrap:
        fixturedef.func = _bounded_fixture(func, fixturedef.argname)
    try:
        return (yield)
    finally:
        if wrap:
            fixturedef.func = func


# -- layer 2: the loop's end -----------------------------------------------------------------
def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio.runners._cancel_all_tasks, bounded: cancelled again until they end."""
    everyone: set[asyncio.Task[Any]] = set()
    deadline = time.monotonic() + SETTLE
    if _current is not None:  # inside the test's bound, with a moment left for the report
        deadline = min(deadline, max(time.monotonic() + 1.0, _current.end - 0.5))
    settle = deadline - time.monotonic()
    while pending := {t for t in asyncio.all_tasks(loop) if not t.done()}:
        everyone |= pending
        if time.monotonic() >= deadline:
            report = where_tasks_wait(loop)
            for task in pending:
                asyncio.tasks._unregister_task(task)  # nothing waits for it any more
            _left_over.append(
                f"{len(pending)} task(s) did not end within {settle:.1f} s of being cancelled "
                f"(again every {RECANCEL_EVERY:g} s) when the test's event loop closed:\n{report}"
            )
            break
        for task in pending:
            task.cancel()
        wait = min(RECANCEL_EVERY, deadline - time.monotonic())
        loop.run_until_complete(asyncio.wait(pending, timeout=max(wait, 0.01)))
    for task in everyone:  # as asyncio's own: an error a task ended with is reported
        if task.done() and not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception during asyncio.run() shutdown",
                    "exception": task.exception(),
                    "task": task,
                }
            )


def pytest_configure(config: pytest.Config) -> None:
    # A private function of asyncio (3.11 to 3.13 alike): asserted, so that a Python that
    # renames it fails here instead of silently losing the bound.
    assert callable(getattr(asyncio.runners, "_cancel_all_tasks", None))
    asyncio.runners._cancel_all_tasks = _cancel_all_tasks  # type: ignore[attr-defined]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    result = yield
    if _left_over:
        reports = "\n".join(_left_over)
        _left_over.clear()
        pytest.fail(reports, pytrace=False)
    return result


# -- layer 3: the process --------------------------------------------------------------------
@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    """pytest-timeout resolved the item's bound (marker, --timeout, ini): every layer's."""
    global _current
    _current = _Bound(item.nodeid, float(settings.timeout), time.monotonic())
    timer = threading.Timer(settings.timeout, _expired, (item, settings))
    timer.name = f"pytest_timeout bound of {item.nodeid}"
    timer.daemon = True
    item.stash[_timer] = timer
    timer.start()
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool:
    global _current
    _current = None
    timer = item.stash.get(_timer, None)
    if timer is not None:
        timer.cancel()
        timer.join()
        del item.stash[_timer]
    return True


def _expired(item: pytest.Item, settings: Any) -> None:
    if not settings.disable_debugger_detection and pytest_timeout.is_debugging():
        return
    out = err = ""
    capman = item.config.pluginmanager.getplugin("capturemanager")
    try:
        if capman is not None:
            capman.suspend_global_capture(item)
            out, err = capman.read_global_capture()
        text = (
            f"\n{'+' * 30} Timeout {'+' * 30}\n{item.nodeid} did not end within its bound "
            f"(timeout = {settings.timeout:g} s), not even when cancelled: its process ends "
            f"here. Where each task and thread waited (the main thread runs the loop):\n"
            f"{where_tasks_wait(_loop)}"
            f"--- captured stdout:\n{out}\n--- captured stderr:\n{err}\n{'+' * 69}\n"
        )
        os.write(2, text.encode("utf-8", "replace"))
    finally:
        os._exit(1)
