"""The generation's buffer (proxy/turn/buffer.py): numbering, resuming and both byte caps, pure."""

from __future__ import annotations

import pytest

from proxy.turn.buffer import Budget, EventBuffer


def _filled(n: int, *, cap: int = 1000, budget: Budget | None = None) -> EventBuffer:
    buffer = EventBuffer(cap, budget or Budget(10_000))
    buffer.add([b"e%d" % i for i in range(1, n + 1)])
    return buffer


def test_events_are_numbered_from_one_and_read_after_a_cursor() -> None:
    buffer = _filled(3)
    assert buffer.last_id == 3
    assert buffer.since(0) == [b"e1", b"e2", b"e3"]
    assert buffer.since(2) == [b"e3"]
    assert buffer.since(3) == []


def test_dropped_events_keep_the_numbers_of_the_ones_after_them() -> None:
    buffer = _filled(5)
    buffer.drop_through(3)
    assert buffer.base == 3 and buffer.last_id == 5
    assert buffer.since(3) == [b"e4", b"e5"]
    assert buffer.since(4) == [b"e5"]
    # A cursor among the dropped events gets nothing, never a later event in its place.
    assert buffer.since(1) == []
    buffer.drop_through(2)  # behind the base already: nothing changes
    assert buffer.since(3) == [b"e4", b"e5"]


@pytest.mark.parametrize(
    ("number", "holds"), [(0, False), (2, False), (3, True), (5, True), (6, False)]
)
def test_a_resume_point_is_held_only_while_nothing_after_it_was_dropped(
    number: int, holds: bool
) -> None:
    buffer = _filled(5)
    buffer.drop_through(3)
    assert buffer.holds(number) is holds


def test_bytes_count_against_the_buffer_and_the_process_and_are_given_back() -> None:
    budget = Budget(100)
    one, two = _filled(3, budget=budget), _filled(2, budget=budget)  # 2 bytes an event
    assert (one.size, two.size, budget.used) == (6, 4, 10)
    one.drop_through(2)
    assert (one.size, budget.used) == (2, 6)
    two.clear()
    assert (two.size, two.since(0), budget.used) == (0, [], 2)


def test_over_cap_is_its_own_cap_or_the_process_s() -> None:
    assert not _filled(3, cap=6).over_cap()
    assert _filled(4, cap=6).over_cap()
    budget = Budget(9)
    _filled(4, budget=budget)  # 8 bytes held by another generation
    assert _filled(1, budget=budget).over_cap()  # under its own cap, over the process's
