"""Incremental splitting of a raw SSE byte stream into whole events.

The relay never re-encodes what the upstream sent: each event keeps its original bytes,
terminators, comments and unknown fields included. The splitter only finds where one
event ends (a blank line, in any of the three line-ending styles of the SSE spec), so that
the relay writes whole events and can put its own frame between two of them.

The proxy's own event ids (`<generation token>-<event number>`, added last to each event so
that a `Last-Event-ID` resumes in the generation it names) are written and read here too.

Pure and I/O-free.
"""

from __future__ import annotations

import re

from proxy.errors import MalformedStream

# A line terminator followed by a second one ends an event. A bare "\r" only counts as
# a terminator when no "\n" follows it, or "\r\n" would be read as two line endings.
_BOUNDARY = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
_LINE_END = re.compile(r"\r\n|\r|\n")

# Below this, rescanning the unfinished event is cheaper than checking whether to.
_PARK_AFTER = 4096
# A boundary is at most four bytes ("\r\n\r\n"); one of them is in the new read.
_TAIL = 3


class SSESplitter:
    """Feed raw chunks, get complete events back.

    `error` is set when the stream turned out malformed (an event over the size limit,
    bytes that are not UTF-8); the events returned before it are good and may be relayed.
    """

    __slots__ = ("_buf", "_max", "_more", "_size", "error")

    def __init__(self, max_event_bytes: int) -> None:
        self._buf = b""  # the unfinished event, as last scanned
        # Reads parked after `_buf` that cannot end it: a long event is scanned once per read
        # and joined once, not rejoined and rescanned on every read (quadratic in its size,
        # on the event loop: seconds for a 16 MiB event).
        self._more: list[bytes] = []
        self._size = 0  # len(_buf) + the parked reads
        self._max = max_event_bytes
        self.error: MalformedStream | None = None

    def feed(self, chunk: bytes) -> list[bytes]:
        # (`find`, not `in`, on every read: dialects.py says why.)
        if (
            not self._size
            and chunk.endswith(b"\n\n")
            and chunk.find(b"\n\n") == len(chunk) - 2
            and chunk.find(b"\r") < 0
            and chunk.isascii()
            and len(chunk) <= self._max
            and self.error is None
        ):
            # The usual read of a paced stream: one whole event and nothing before it. The
            # general path below gives the same answer, with three calls and a copy more.
            return [chunk]
        if self.error is not None or not chunk:
            return []
        if self._size >= _PARK_AFTER and not _may_end_event(self._tail() + chunk):
            self._more.append(chunk)
            self._size += len(chunk)
            if self._size > self._max:
                self._too_big()
            return []
        buf = b"".join((self._buf, *self._more, chunk)) if self._size else chunk
        self._more = []
        if buf.find(b"\r") >= 0:
            events, rest = _split_general(buf)
        else:
            events, rest = _split_lf(buf)
        self._buf, self._size = rest, len(rest)
        if len(buf) > self._max:
            # One read may hold a whole event over the limit, not only an unfinished one.
            for i, event in enumerate(events):
                if len(event) > self._max:
                    self._too_big()
                    return self._validated(events[:i])
        if len(rest) > self._max:
            self._too_big()
        return self._validated(events)

    @property
    def holding(self) -> bool:
        """Part of an unfinished event is held (what `flush` would complete)."""
        return self._size > 0

    def flush(self) -> list[bytes]:
        """At end of stream: an unterminated last event is completed, not lost."""
        rest = b"".join((self._buf, *self._more))
        self._buf, self._more, self._size = b"", [], 0
        if self.error is not None or not rest.strip(b"\r\n"):
            return []
        return self._validated([rest + b"\n\n"])

    def _tail(self) -> bytes:
        # The last bytes buffered that, with a new read, hold any boundary it may end.
        tail = self._buf[-_TAIL:]
        for part in self._more[-_TAIL:]:  # parked reads are never empty
            tail = (tail + part[-_TAIL:])[-_TAIL:]
        return tail

    def _too_big(self) -> None:
        self._fail(
            MalformedStream(f"the upstream sent an SSE event over the {self._max}-byte limit")
        )

    def _fail(self, error: MalformedStream) -> None:
        # The stream ends here: what is held is dropped at once (up to a whole event's
        # limit), not kept until the stream's object goes.
        self._buf, self._more, self._size = b"", [], 0
        self.error = error

    def _validated(self, events: list[bytes]) -> list[bytes]:
        if not events:
            return events
        joined = events[0] if len(events) == 1 else b"".join(events)
        if joined.isascii():  # most events are: no decoding, no copy
            return events
        try:
            joined.decode("utf-8")
            return events
        except UnicodeDecodeError:
            pass
        for i, event in enumerate(events):
            try:
                event.decode("utf-8")
            except UnicodeDecodeError:
                self._fail(MalformedStream("the upstream sent an SSE event that is not UTF-8"))
                return events[:i]
        return events  # pragma: no cover - the joined check failed, so one event must


def _may_end_event(window: bytes) -> bool:
    """Whether an event boundary may end in `window` (a new read after the last _TAIL bytes
    buffered, which is as far back as a boundary reaching into the read can start)."""
    if window.find(b"\r") < 0:
        return window.find(b"\n\n") >= 0
    return _BOUNDARY.search(window) is not None


def _split_lf(buf: bytes) -> tuple[list[bytes], bytes]:
    # The common case (no "\r" anywhere): one C-level split, no regex. Boundaries are found
    # left to right like _BOUNDARY does, so that "\n\n\n" ends the event after two newlines
    # whichever path (and chunking) saw it.
    if buf.find(b"\n\n") < 0:
        return [], buf
    *parts, rest = buf.split(b"\n\n")
    return [p + b"\n\n" for p in parts], rest


def _split_general(buf: bytes) -> tuple[list[bytes], bytes]:
    # A trailing "\r" may be the first half of "\r\n": wait for the next byte.
    limit = len(buf) - 1 if buf.endswith(b"\r") else len(buf)
    events: list[bytes] = []
    start = 0
    for match in _BOUNDARY.finditer(buf, 0, limit):
        events.append(buf[start : match.end()])
        start = match.end()
    return events, buf[start:]


def parse_fields(event: bytes) -> dict[str, str]:
    """The `event` and `data` fields of one raw event (data lines joined by "\\n").

    Used off the hot path only: to build a superseded frame that matches the stream, and
    in tests. Comments and other fields are ignored, as a client would.
    """
    fields: dict[str, str] = {}
    data: list[str] = []
    for line in _LINE_END.split(event.decode("utf-8", errors="replace")):
        if not line or line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name in ("event", "id"):
            fields[name] = value
    if data:
        fields["data"] = "\n".join(data)
    return fields


def encode_event(data: str, event: str | None = None) -> bytes:
    """One SSE event in the plainest form every client parses."""
    head = f"event: {event}\n" if event else ""
    body = "".join(f"data: {line}\n" for line in data.split("\n"))
    return (head + body + "\n").encode()


def event_id(token: int, number: int) -> bytes:
    """The proxy's id of event `number` of the generation whose fencing token is `token`."""
    return b"%d-%d" % (token, number)


def resumes_after(last_event_id: bytes | None, token: int) -> int | None:
    """The event number a `Last-Event-ID` names in generation `token`; None when it is not
    one of the proxy's ids of that generation (a client's own, another turn's, garbage)."""
    if last_event_id is None:
        return None
    given, _, number = last_event_id.strip().partition(b"-")
    if not given.isdigit() or not number.isdigit() or len(given) > 20 or len(number) > 12:
        return None
    return int(number) if int(given) == token else None


def with_id(event: bytes, event_id: bytes) -> bytes:
    """`event` with an `id:` line added last, so that it wins over an upstream id of its own."""
    if event.endswith(b"\r\n"):
        end = b"\r\n"
    elif event.endswith(b"\n"):
        end = b"\n"
    else:
        end = b"\r"
    return event[: -len(end)] + b"id: " + event_id + end + end
