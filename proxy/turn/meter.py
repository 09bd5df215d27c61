"""What a generation's answer cost, read as it passes (issue 30): the provider's own usage
report, found where each dialect puts it (proxy/wire/usage.py), never by parsing every event.

A stream is looked at twice: its first content event (Anthropic's `message_start` carries
the input tokens, so a generation fenced mid-answer still has them) and its last few events
(every dialect reports its final counts at the end); the generation keeps those last events
as they go by (`tail`, a bounded deque extended once a read). A body that is not a stream is
kept, by reference, up to the size worth parsing, and read once at its end.
"""

from __future__ import annotations

from collections import deque

from proxy.wire import usage
from proxy.wire.usage import Usage


class Meter:
    __slots__ = ("_body", "_body_size", "_dialect", "opening", "tail", "usage")

    def __init__(self, dialect: str) -> None:
        self._dialect = dialect
        # Waiting for the first content event, where the dialect reports anything there.
        self.opening = usage.reports_opening(dialect)
        self.tail: deque[bytes] = deque(maxlen=usage.TAIL_EVENTS)  # the last events read
        self.usage: Usage | None = None  # what is known so far
        self._body: list[bytes] | None = []  # a body's parts; None once over the size cap
        self._body_size = 0

    def opened(self, events: list[bytes]) -> None:
        """The first read with content: its first content event may report usage."""
        self.opening = False
        for event in events:
            found = usage.opening(self._dialect, event)
            if found is not None:
                self.usage = found
                return

    def body(self, chunk: bytes) -> None:
        """A chunk of a body that is not an event stream."""
        if self._body is None:
            return
        self._body_size += len(chunk)
        if self._body_size > usage.MAX_BODY_BYTES:
            self._body = None  # too large to look at: unknown
        else:
            self._body.append(chunk)

    def close(self, is_sse: bool) -> Usage | None:
        """The answer is all in (or cut): what it reported."""
        if is_sse:
            final = usage.closing(self._dialect, list(self.tail))
        else:
            whole = b"".join(self._body) if self._body else b""
            final = usage.of_body(self._dialect, whole) if whole else None
        self._body = None
        self.tail.clear()
        self.usage = final if self.usage is None else self.usage.merged(final)
        return self.usage
