"""What a generation's answer cost, read once it is over (issue 30): the provider's own usage
report, found where each dialect puts it (proxy/wire/usage.py), never by parsing every event.

A stream is looked at twice: its first content event (Anthropic's `message_start` carries
the input tokens, so a generation fenced mid-answer still has them) and, at its end, its last
few events (every dialect reports its final counts there), which are still in the
generation's buffer. A buffer over its cap drops what its clients have written: it tells the
meter first (`dropping`), which keeps the last few. A body that is not a stream is read from
the buffer at its end, decoded from its Content-Encoding, under a size cap; one the buffer
had to drop is unknown. Nothing here runs per relayed event.
"""

from __future__ import annotations

from proxy.asgi import Headers
from proxy.turn.buffer import EventBuffer
from proxy.wire import codings, usage
from proxy.wire.usage import TAIL_EVENTS, Usage


class Meter:
    __slots__ = ("_dialect", "_tail", "_tail_end", "opening", "usage")

    def __init__(self, dialect: str) -> None:
        self._dialect = dialect
        # Waiting for the first content event, where the dialect reports anything there.
        self.opening = usage.reports_opening(dialect)
        self.usage: Usage | None = None  # what is known so far
        self._tail: list[bytes] = []  # the last events before the buffer last dropped any
        self._tail_end = 0  # ... and the number of the last of them

    def opened(self, events: list[bytes]) -> None:
        """The first read with content: its first content event may report usage."""
        self.opening = False
        for event in events:
            found = usage.opening(self._dialect, event)
            if found is not None:
                self.usage = found
                return

    def dropping(self, buffer: EventBuffer) -> None:
        """`buffer` is about to drop events its clients have written: keep the last few."""
        self._tail = self._last(buffer)
        self._tail_end = buffer.last_id

    def close(self, is_sse: bool, buffer: EventBuffer, headers: Headers) -> Usage | None:
        """The answer is all in (or cut): what it reported."""
        if is_sse:
            last = self._last(buffer)
            # Most streams report nothing (an OpenAI client that did not ask): no parse.
            final = usage.closing(self._dialect, last) if _mention_usage(last) else None
        elif buffer.base == 0 and buffer.events and buffer.size <= usage.MAX_BODY_BYTES:
            whole = b"".join(buffer.events)  # (0 < base: the buffer dropped some: unknown)
            coding = next((v for n, v in headers if n.lower() == b"content-encoding"), b"")
            body = codings.decoded(whole, coding, usage.MAX_BODY_BYTES)
            final = None if body is None else usage.of_body(self._dialect, body)
        else:
            final = None
        if final is not None:
            self.usage = final if self.usage is None else self.usage.merged(final)
        return self.usage

    def _last(self, buffer: EventBuffer) -> list[bytes]:
        """The last TAIL_EVENTS events: those kept at the last drop, then the buffer's own."""
        if not self._tail:  # nothing dropped: the buffer has them all
            return buffer.events[-TAIL_EVENTS:]
        newer = buffer.since(max(self._tail_end, buffer.last_id - TAIL_EVENTS))
        return (self._tail + newer)[-TAIL_EVENTS:]


def _mention_usage(events: list[bytes]) -> bool:
    for event in events:
        if event.find(b"usage") >= 0:  # "usage", "usageMetadata" (find: cheaper than `in`)
            return True
    return False
