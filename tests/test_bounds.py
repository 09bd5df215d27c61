"""The suite's own bound (tests/bounds.py), on tests that hang the ways tests have hung: run
by a pytest of their own (a process, under pytest-xdist as CI runs), with a 3 s bound."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = """
import asyncio
import time

import pytest

pytest_plugins = ["tests.bounds"]


def pytest_pycollect_makeitem(collector, name, obj):
    import inspect
    if inspect.iscoroutinefunction(obj) and name.startswith("test"):
        pytest.mark.anyio(obj)


@pytest.fixture
def anyio_backend():
    return "asyncio"
"""

TESTS = """
import asyncio
import time

import pytest


async def never_ends() -> None:
    try:
        await asyncio.Event().wait()
    finally:  # the last client's leaving, waiting for what never comes
        await asyncio.shield(asyncio.Event().wait())


async def test_swallows_the_cancellation_and_waits() -> None:
    # The pattern that hung for six minutes: the runner's cancellation is taken for the task's.
    task = asyncio.create_task(never_ends())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.fixture
async def teardown_waits():
    yield
    await asyncio.Event().wait()


async def test_teardown_waits(teardown_waits: None) -> None:
    pass


async def test_leaves_a_task_that_refuses_to_end() -> None:
    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                pass

    asyncio.get_running_loop().create_task(stubborn())


async def test_leaves_a_task_that_swallows_one_cancellation() -> None:
    async def once() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(60)

    asyncio.get_running_loop().create_task(once())


async def test_blocks_its_loop() -> None:
    time.sleep(60)


async def test_ends() -> None:
    await asyncio.sleep(0)
"""


def test_every_way_of_hanging_ends_within_the_bound_with_where_it_waited(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_hangs.py").write_text(textwrap.dedent(TESTS))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ["-p", "no:cacheprovider", "--timeout", "3", "-n", "2", "-rA"]
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "test_hangs.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    out = run.stdout + run.stderr
    summary = {
        line.split(" ", 2)[1].split("::")[-1].removesuffix("[asyncio]"): line.split(" ", 1)[0]
        for line in run.stdout.splitlines()
        if line.startswith(("PASSED ", "FAILED ", "ERROR "))
    }
    assert summary == {
        "test_swallows_the_cancellation_and_waits": "FAILED",
        "test_teardown_waits": "ERROR",
        "test_leaves_a_task_that_refuses_to_end": "ERROR",
        "test_leaves_a_task_that_swallows_one_cancellation": "PASSED",
        "test_blocks_its_loop": "FAILED",
        "test_ends": "PASSED",
    }, out
    # Layer 1: where the swallowing test and the task it waited for were, in the report.
    assert "did not end within its test's bound (timeout = 3 s)" in out
    assert "in never_ends" in out and "await asyncio.shield(" in out
    assert "the teardown of fixture 'teardown_waits' did not end" in out
    # Layer 2: the task that refuses every cancellation, named at its test's teardown.
    assert "1 task(s) did not end within" in out and "in stubborn" in out
    # Layer 3: the blocked loop, on the controller's stderr, its worker replaced.
    assert (
        "test_blocks_its_loop[asyncio] did not end within its bound (timeout = 3 s)" in run.stderr
    )
    assert "time.sleep(60)" in run.stderr
    assert "crashed while running 'test_hangs.py::test_blocks_its_loop'" in out
    assert took < 60, out
