"""What a generation's answer cost (issue 30): the provider's own usage report, found where
each dialect puts it (proxy/wire/usage.py), read from the generation's buffer, never per
relayed event.

Two places hold it: the answer's first events (Anthropic's `message_start` carries the input
tokens, so a generation fenced mid-answer still has them), read when someone asks what is known
so far (the status page) or at the end; and its last few events (every dialect reports its
final counts there), read once the answer is over. A buffer over its cap drops what its clients
have written: it tells the meter first (`dropping`), which reads the opening and keeps the last
few events. A body that is not a stream is read from the buffer at its end, decoded from its
Content-Encoding, under a size cap; one the buffer had to drop is unknown.
"""

from __future__ import annotations

from proxy.asgi import Headers
from proxy.turn.buffer import EventBuffer
from proxy.wire import codings, usage
from proxy.wire.usage import TAIL_EVENTS, Usage


class Meter:
    __slots__ = ("_buffer", "_dialect", "_final", "_opening", "_opening_read", "_tail", "_tail_end")

    def __init__(self, dialect: str, buffer: EventBuffer) -> None:
        self._dialect = dialect
        self._buffer = buffer
        self._opening: Usage | None = None  # what the answer's first events reported
        self._opening_read = not usage.reports_opening(dialect)
        self._final: Usage | None = None  # what the answer's end reported
        self._tail: list[bytes] = []  # the last events before the buffer last dropped any
        self._tail_end = 0  # ... and the number of the last of them

    @property
    def usage(self) -> Usage | None:
        """What is known so far (at the end: everything the answer reported)."""
        opening = self._read_opening()
        if opening is None:
            return self._final
        return opening if self._final is None else opening.merged(self._final)

    def dropping(self) -> None:
        """The buffer is about to drop events its clients have written: keep what they say."""
        self._read_opening(settle=True)  # its first events are about to go
        self._tail = self._last()
        self._tail_end = self._buffer.last_id

    def close(self, is_sse: bool, headers: Headers) -> Usage | None:
        """The answer is all in (or cut): what it reported."""
        self._read_opening(settle=True)  # before the buffer is cleared
        buffer = self._buffer
        if is_sse:
            last = self._last()
            # Most streams report nothing (an OpenAI client that did not ask): no parse.
            self._final = usage.closing(self._dialect, last) if _mention_usage(last) else None
        elif buffer.base == 0 and buffer.events and buffer.size <= usage.MAX_BODY_BYTES:
            whole = b"".join(buffer.events)  # (0 < base: the buffer dropped some: unknown)
            coding = next((v for n, v in headers if n.lower() == b"content-encoding"), b"")
            body = codings.decoded(whole, coding, usage.MAX_BODY_BYTES)
            self._final = None if body is None else usage.of_body(self._dialect, body)
        self._tail = []
        return self.usage

    def _read_opening(self, settle: bool = False) -> Usage | None:
        """The first events' report, read from the buffer until it is known for good: found,
        or looked for in a whole window of first events, or `settle` (they are about to go)."""
        if not self._opening_read:
            first = self._buffer.events[:TAIL_EVENTS]
            for event in first:
                self._opening = usage.opening(self._dialect, event)
                if self._opening is not None:
                    break
            self._opening_read = settle or self._opening is not None or len(first) == TAIL_EVENTS
        return self._opening

    def _last(self) -> list[bytes]:
        """The last TAIL_EVENTS events: those kept at the last drop, then the buffer's own."""
        buffer = self._buffer
        if not self._tail:  # nothing dropped: the buffer has them all
            return buffer.events[-TAIL_EVENTS:]
        newer = buffer.since(max(self._tail_end, buffer.last_id - TAIL_EVENTS))
        return (self._tail + newer)[-TAIL_EVENTS:]


def _mention_usage(events: list[bytes]) -> bool:
    for event in events:
        if event.find(b"usage") >= 0:  # "usage", "usageMetadata" (find: cheaper than `in`)
            return True
    return False
