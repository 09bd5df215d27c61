"""A generation's buffer: its events, numbered from 1, and the bytes they hold against two
caps, the generation's own and the process's (`Budget`, over every buffer).

Followers read it from their own cursor, and a `Last-Event-ID` resumes in it. Over a cap
the generation lets nobody follow any more, and its buffer then keeps only what its clients
have yet to write (`drop_through`). Pure and I/O-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Budget:
    """The byte cap over every generation buffer of the process."""

    total: int
    used: int = 0
    overflows: int = 0


class EventBuffer:
    __slots__ = ("base", "budget", "cap", "events", "size")

    def __init__(self, cap: int, budget: Budget) -> None:
        self.events: list[bytes] = []  # events[i] is event number base + i + 1
        self.base = 0  # the events up to this number are dropped
        self.size = 0  # bytes held
        self.cap = cap  # bytes, for this buffer
        self.budget = budget

    @property
    def last_id(self) -> int:
        return self.base + len(self.events)

    def add(self, events: list[bytes]) -> None:
        self.events += events
        added = len(events[0]) if len(events) == 1 else sum(map(len, events))
        self.size += added
        self.budget.used += added

    def over_cap(self) -> bool:
        return self.size > self.cap or self.budget.used > self.budget.total

    def since(self, cursor: int) -> list[bytes]:
        """The events after number `cursor` (none before the buffer's base)."""
        return self.events[cursor - self.base :] if cursor >= self.base else []

    def holds(self, number: int) -> bool:
        """A client may resume after event `number`: nothing after it was dropped."""
        return self.base <= number <= self.last_id

    def drop_through(self, number: int) -> None:
        """Forget the events up to `number`: every client has written them."""
        drop = number - self.base
        if drop > 0:
            freed = sum(map(len, self.events[:drop]))
            del self.events[:drop]
            self.base = number
            self.size -= freed
            self.budget.used -= freed

    def clear(self) -> None:
        self.budget.used -= self.size
        self.events, self.size = [], 0
