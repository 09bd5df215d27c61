"""proxy.wire.sse: the splitter finds event boundaries without changing a byte, whatever the
chunking and line endings; checked against an independent WHATWG-style reference parser."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.errors import MalformedStream
from proxy.wire import sse
from proxy.wire.sse import SSESplitter, encode_event, event_id, parse_fields, resumes_after


@pytest.fixture(scope="module", autouse=True, params=["rescan", "park"])
def parking(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test runs twice: as shipped (an unfinished event under 4 KiB is rescanned on
    each read), and with every read that cannot end the event parked, however short."""
    saved = sse._PARK_AFTER
    sse._PARK_AFTER = 0 if request.param == "park" else saved
    yield
    sse._PARK_AFTER = saved


# --- an independent reference: the WHATWG "interpreting an event stream" rules ---------


@dataclass
class Dispatched:
    type: str
    data: str
    last_event_id: str


@dataclass
class Reference:
    """Line-by-line, as EventSource does it: a blank line dispatches, comments are ignored,
    unknown fields are ignored, `id` persists, a CR LF pair is one line ending."""

    events: list[Dispatched] = field(default_factory=list)
    _text: str = ""
    _data: str = ""
    _type: str = ""
    _id: str = ""

    def feed(self, text: str) -> None:
        self._text += text
        while True:
            cr, lf = self._text.find("\r"), self._text.find("\n")
            ends = [i for i in (cr, lf) if i >= 0]
            if not ends:
                return
            end = min(ends)
            if end == cr and end == len(self._text) - 1:
                return  # a CR at the very end may be the first half of CR LF
            line = self._text[:end]
            step = 2 if self._text[end : end + 2] == "\r\n" else 1
            self._text = self._text[end + step :]
            self._line(line)

    def _line(self, line: str) -> None:
        if not line:
            if self._data:
                self.events.append(Dispatched(self._type or "message", self._data[:-1], self._id))
            self._data, self._type = "", ""
            return
        if line.startswith(":"):
            return
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data += value + "\n"
        elif name == "event":
            self._type = value
        elif name == "id" and "\0" not in value:
            self._id = value

    def close(self) -> None:
        """End of input: a CR held back is a line ending after all; the rest is discarded."""
        if self._text.endswith("\r"):
            self.feed("\n")  # CR LF is one line ending, as the lone CR was

    @property
    def pending(self) -> bool:
        """Something was read that no blank line has completed yet."""
        return bool(self._text or self._data or self._type)


def reference_events(stream: bytes) -> list[Dispatched]:
    ref = Reference()
    ref.feed(stream.decode("utf-8"))
    ref.close()
    return ref.events


# --- helpers -----------------------------------------------------------------------------

MAX = 1 << 20  # the event size limit, where a test is not about it


def split_all(chunks: list[bytes], max_event_bytes: int = MAX) -> list[bytes]:
    splitter = SSESplitter(max_event_bytes)
    out: list[bytes] = []
    for chunk in chunks:
        out += splitter.feed(chunk)
    out += splitter.flush()
    assert splitter.error is None
    return out


def cut(data: bytes, points: list[int]) -> list[bytes]:
    edges = [0, *sorted(set(points)), len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


# Events as real providers send them, in each line-ending style.
EVENTS_LF = [
    b'data: {"id":"c1","choices":[{"delta":{"content":"Hel"}}]}\n\n',
    b": keep-alive comment\n\n",
    b'event: message_start\ndata: {"type":"message_start"}\n\n',
    b"id: 42\nretry: 3000\ndata: first line\ndata: second line\n\n",
    b"data:no-space\nfoo: an unknown field\nevent\ndata\n\n",
    "data: caf\u00e9 \u2603 \U0001f600 multi-byte\n\n".encode(),
    b"data: [DONE]\n\n",
]


def restyle(event: bytes, ending: bytes) -> bytes:
    return event.replace(b"\n", ending)


STYLES = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}


def styled_events(style: str) -> list[bytes]:
    if style == "mixed":
        endings = [b"\n", b"\r\n", b"\r", b"\r\n", b"\n", b"\r", b"\r\n"]
        return [restyle(e, end) for e, end in zip(EVENTS_LF, endings, strict=True)]
    return [restyle(e, STYLES[style]) for e in EVENTS_LF]


def expected_after_flush(events: list[bytes]) -> list[bytes]:
    # An event whose blank line is a bare CR cannot be told from the first half of a CR LF
    # until another byte comes; at end of stream flush() completes it with "\n\n".
    if events and events[-1].endswith(b"\r") and not events[-1].endswith(b"\r\n"):
        return [*events[:-1], events[-1] + b"\n\n"]
    return events


ALL_STYLES = ["lf", "crlf", "cr", "mixed"]


# --- chunking -----------------------------------------------------------------------------


@pytest.mark.parametrize("style", ALL_STYLES)
def test_whole_stream_in_one_chunk(style: str) -> None:
    events = styled_events(style)
    assert split_all([b"".join(events)]) == expected_after_flush(events)


@pytest.mark.parametrize("style", ALL_STYLES)
def test_every_single_split_point(style: str) -> None:
    events = styled_events(style)
    stream = b"".join(events)
    for point in range(len(stream) + 1):
        assert split_all(cut(stream, [point])) == expected_after_flush(events), point


@pytest.mark.parametrize("style", ALL_STYLES)
def test_byte_by_byte(style: str) -> None:
    events = styled_events(style)
    stream = b"".join(events)
    assert split_all([stream[i : i + 1] for i in range(len(stream))]) == expected_after_flush(
        events
    )


@pytest.mark.parametrize("style", ALL_STYLES)
def test_events_come_out_as_soon_as_they_are_complete(style: str) -> None:
    # No event is held back waiting for the next one (CONTRACT section 5), except the bare-CR
    # case that cannot be decided yet.
    events = styled_events(style)
    splitter = SSESplitter(MAX)
    for event in events:
        out = splitter.feed(event)
        if event.endswith(b"\r") and not event.endswith(b"\r\n"):
            continue
        assert out[-1:] == [event], event


@settings(max_examples=300, deadline=None)
@given(data=st.data(), style=st.sampled_from(ALL_STYLES))
def test_random_chunking(data: st.DataObject, style: str) -> None:
    events = styled_events(style)
    stream = b"".join(events)
    points = data.draw(st.lists(st.integers(0, len(stream)), max_size=40))
    assert split_all(cut(stream, points)) == expected_after_flush(events)


def test_trailing_cr_that_turns_out_to_be_crlf() -> None:
    splitter = SSESplitter(MAX)
    # "\r\n\r" could end the event (CR LF then CR) or be half of a CR LF blank line.
    assert splitter.feed(b"data: a\r\n\r") == []
    assert splitter.feed(b"\n") == [b"data: a\r\n\r\n"]
    assert splitter.feed(b"data: b\r\n") == []
    assert splitter.feed(b"\r") == []
    # The next byte decides: not a LF, so the CR was a blank line of its own.
    assert splitter.feed(b"data: c\r\r") == [b"data: b\r\n\r"]
    assert splitter.flush() == [b"data: c\r\r\n\n"]
    assert splitter.error is None


def test_cr_then_lf_in_one_line_ending_is_not_a_blank_line() -> None:
    splitter = SSESplitter(MAX)
    assert splitter.feed(b"data: a\r") == []
    assert splitter.feed(b"\ndata: b\r") == []
    assert splitter.feed(b"\n") == []
    assert splitter.feed(b"\r\n") == [b"data: a\r\ndata: b\r\n\r\n"]


def test_comments_unknown_fields_id_and_retry_pass_through_unchanged() -> None:
    event = b": hi\nid: 7\nretry: 10\nx-custom: y\nevent: e\ndata: d\n\n"
    assert split_all([event]) == [event]
    assert parse_fields(event) == {"id": "7", "event": "e", "data": "d"}


# --- flush --------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", [b"data: x", b"data: x\n", b"data: x\r\n", b"data: x\r"])
def test_flush_completes_an_unterminated_last_event(tail: bytes) -> None:
    splitter = SSESplitter(MAX)
    assert splitter.feed(b"data: a\n\n" + tail) == [b"data: a\n\n"]
    (last,) = splitter.flush()
    assert last.startswith(tail)
    assert [e.data for e in reference_events(last)] == ["x"]
    assert splitter.flush() == []


@pytest.mark.parametrize("tail", [b"", b"\n", b"\r\n", b"\r", b"\r\n\r"])
def test_flush_returns_nothing_for_leftover_line_endings(tail: bytes) -> None:
    splitter = SSESplitter(MAX)
    assert splitter.feed(b"data: a\n\n" + tail) == [b"data: a\n\n"]
    assert splitter.flush() == []


def test_holding_says_whether_part_of_an_event_is_held() -> None:
    # The upstream client ends a response with its last read only when nothing is held.
    splitter = SSESplitter(MAX)
    assert not splitter.holding
    assert splitter.feed(b"data: a\n\n") == [b"data: a\n\n"] and not splitter.holding
    assert splitter.feed(b"data: b") == [] and splitter.holding
    assert splitter.feed(b"\n\n") == [b"data: b\n\n"] and not splitter.holding
    for _ in range(3):  # past the size where reads are parked
        assert splitter.feed(b"data: " + b"c" * 4096 + b"\n") == [] and splitter.holding
    assert len(splitter.flush()) == 1 and not splitter.holding


# --- malformed streams --------------------------------------------------------------------


def test_event_over_the_limit_still_buffering_sets_error_after_the_good_events() -> None:
    splitter = SSESplitter(max_event_bytes=64)
    good = b"data: ok\n\n"
    assert splitter.feed(good + b"data: " + b"x" * 100) == [good]
    assert isinstance(splitter.error, MalformedStream)
    assert "64-byte limit" in splitter.error.message
    assert splitter.feed(b"\n\ndata: later\n\n") == []
    assert splitter.flush() == []


def test_complete_event_over_the_limit_in_one_read_sets_error() -> None:
    splitter = SSESplitter(max_event_bytes=64)
    good = b"data: ok\n\n"
    big = b"data: " + b"x" * 100 + b"\n\n"
    assert splitter.feed(good + big + good) == [good]
    assert isinstance(splitter.error, MalformedStream)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_limit_is_exact_whatever_the_chunking(ending: bytes) -> None:
    limit = 40

    def event(size: int) -> bytes:
        frame = b"data: " + ending + ending
        return b"data: " + b"y" * (size - len(frame)) + ending + ending

    at_limit, over = event(limit), event(limit + 1)
    assert len(at_limit) == limit and len(over) == limit + 1
    for chunks in ([at_limit], [at_limit[i : i + 1] for i in range(limit)]):
        assert split_all(chunks, max_event_bytes=limit) == expected_after_flush([at_limit])
    # Two at the limit in one read, and one held whole until the next read.
    assert split_all([at_limit * 2], max_event_bytes=limit) == expected_after_flush([at_limit] * 2)
    twice = [at_limit, at_limit + b"data: z" + ending]
    assert split_all(twice, max_event_bytes=limit)[:2] == [at_limit, at_limit]
    for chunks in ([over], [over[i : i + 1] for i in range(limit + 1)]):
        splitter = SSESplitter(limit)
        out = [e for c in chunks for e in splitter.feed(c)]
        assert out == [] and isinstance(splitter.error, MalformedStream)


@pytest.mark.parametrize("read", [1000, 4096, 5000])
def test_endless_event_fails_as_soon_as_it_is_over_the_limit(read: int) -> None:
    # Past the parking threshold, reads are parked rather than rescanned: the limit must
    # still hold there, and nothing parked may leak out afterwards.
    limit = 3 * 4096
    splitter = SSESplitter(limit)
    assert splitter.feed(b"data: ok\n\n") == [b"data: ok\n\n"]
    fed = 0
    chunk = b"data: " + b"z" * (read - 7) + b"\n"
    while splitter.error is None:
        assert splitter.feed(chunk) == []
        fed += len(chunk)
        assert fed <= limit + len(chunk)
    assert fed > limit
    assert isinstance(splitter.error, MalformedStream)
    assert splitter.feed(b"\n") == [] and splitter.flush() == []


def test_invalid_utf8_in_one_event_of_a_batch() -> None:
    splitter = SSESplitter(MAX)
    first, second = b"data: one\n\n", b"data: two\n\n"
    bad = b"data: \xff\xfe\n\n"
    assert splitter.feed(first + second + bad + b"data: after\n\n") == [first, second]
    assert isinstance(splitter.error, MalformedStream)
    assert "UTF-8" in splitter.error.message
    assert splitter.feed(b"data: more\n\n") == []
    assert splitter.flush() == []


def test_invalid_utf8_in_the_second_of_two_events_of_a_read() -> None:
    splitter = SSESplitter(MAX)
    assert splitter.feed(b"data: one\n\n" + b"data: \xff\n\n") == [b"data: one\n\n"]
    assert isinstance(splitter.error, MalformedStream)


def test_invalid_utf8_in_the_unterminated_tail_at_flush() -> None:
    splitter = SSESplitter(MAX)
    assert splitter.feed(b"data: ok\n\ndata: \xc3") == [b"data: ok\n\n"]
    assert splitter.flush() == []
    assert isinstance(splitter.error, MalformedStream)


@pytest.mark.parametrize(
    ("limit", "reads"),
    [
        (64, [b"data: ok\n\ndata: " + b"x" * 100]),  # an unfinished event over the limit
        (64, [b"data: ok\n\n", b"data: " + b"x" * 40, b"x" * 20 + b"\n\ndata: more"]),
        (6000, [b"data: " + b"x" * 4096 + b"\n"] * 2),  # parked reads over the limit
        (64, [b"data: \xff\n\ndata: unfinished"]),  # not UTF-8, with more held after it
    ],
    ids=["unfinished", "whole", "parked", "utf8"],
)
def test_a_malformed_stream_drops_all_it_held(limit: int, reads: list[bytes]) -> None:
    splitter = SSESplitter(limit)
    for read in reads:
        splitter.feed(read)
    assert isinstance(splitter.error, MalformedStream)
    assert not splitter.holding and splitter.flush() == [] and splitter.feed(b"\n\n") == []


def test_multibyte_character_split_across_chunks_is_not_an_error() -> None:
    event = "data: \u00e9\u2603\U0001f600\n\n".encode()
    for point in range(len(event) + 1):
        assert split_all(cut(event, [point])) == [event]


# --- property: against the reference parser ---------------------------------------------

VALUE = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n\0"),
    max_size=12,
)
LINE = st.one_of(
    VALUE.map(lambda v: "data: " + v),
    VALUE.map(lambda v: "data:" + v),
    st.just("data"),
    VALUE.map(lambda v: "event: " + v),
    VALUE.map(lambda v: "id: " + v),
    st.integers(0, 99999).map(lambda n: f"retry: {n}"),
    VALUE.map(lambda v: ":" + v),
    st.sampled_from(["foo", "x-y", "DATA", "Event"]).flatmap(
        lambda name: VALUE.map(lambda v: f"{name}: {v}")
    ),
)
ENDING = st.sampled_from(["\n", "\r\n", "\r"])


@st.composite
def event_text(draw: st.DrawFn) -> str:
    lines = draw(st.lists(st.tuples(LINE, ENDING), min_size=1, max_size=5))
    text = "".join(line + end for line, end in lines)
    blank = draw(ENDING)
    if lines[-1][1] == "\r" and blank == "\n":
        blank = "\r\n"  # "\r" + "\n" is one line ending, not a line and a blank line
    return text + blank


@settings(max_examples=400, deadline=None)
@given(data=st.data(), events=st.lists(event_text(), max_size=8))
def test_matches_the_reference_parser_for_any_chunking(
    data: st.DataObject, events: list[str]
) -> None:
    raw = [e.encode() for e in events]
    stream = b"".join(raw)
    points = data.draw(st.lists(st.integers(0, len(stream)), max_size=30))
    out = split_all(cut(stream, points))

    # Byte-identical, event for event (flush may only complete a trailing bare-CR blank line).
    assert out == expected_after_flush(raw)

    # Same events as a reference client reading the raw stream, and each output event is
    # whole: it dispatches at most one event and leaves nothing pending.
    whole = Reference()
    for event in out:
        alone = Reference()
        alone.feed(event.decode())
        alone.close()
        assert not alone.pending, event
        assert len(alone.events) <= 1, event
        whole.feed(event.decode())
        fields = parse_fields(event)
        if alone.events:
            (got,) = alone.events
            assert fields["data"] == got.data
            assert (fields.get("event") or "message") == got.type
        else:
            assert "data" not in fields
    whole.close()
    assert whole.events == reference_events(stream)


# --- parse_fields and encode_event --------------------------------------------------------


def test_parse_fields_follows_the_spec_details() -> None:
    assert parse_fields(b"data\n\n") == {"data": ""}
    assert parse_fields(b"data:  two spaces\n\n") == {"data": " two spaces"}
    assert parse_fields(b"event: a\nevent: b\ndata: x\n\n") == {"event": "b", "data": "x"}
    assert parse_fields(b"data: a\r\ndata: b\rdata: c\n\n") == {"data": "a\nb\nc"}
    assert parse_fields(b": only a comment\n\n") == {}
    assert parse_fields(b"retry: 5\nfoo: bar\n\n") == {}


NO_LINE_BREAKS = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\0"),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(data=NO_LINE_BREAKS, event=st.none() | VALUE.filter(bool))
def test_encode_event_round_trips(data: str, event: str | None) -> None:
    # SSE data cannot carry a CR (it is a line ending); every JSON frame escapes it.
    raw = encode_event(data, event)
    assert split_all([raw]) == [raw]
    fields = parse_fields(raw)
    assert fields["data"] == data
    assert fields.get("event") == event
    (dispatched,) = reference_events(raw)
    assert dispatched.data == data
    assert dispatched.type == (event or "message")
    assert re.fullmatch(rb"(event: [^\r\n]*\n)?(data: [^\r\n]*\n)+\n", raw)


# --- property: any bytes at all -----------------------------------------------------------

NOISE = st.lists(
    st.sampled_from([b"a", b"\r", b"\n", b":", b" ", b"data: x", b"\r\n"]), max_size=40
)


@settings(max_examples=500, deadline=None)
@given(data=st.data(), pieces=NOISE)
def test_any_stream_splits_the_same_way_whatever_the_chunking(
    data: st.DataObject, pieces: list[bytes]
) -> None:
    # Even for odd input (extra blank lines, bare CRs), where events end does not depend on
    # how the stream was cut, and no byte is lost or added before flush().
    stream = b"".join(pieces)
    points = data.draw(st.lists(st.integers(0, len(stream)), max_size=20))

    def run(chunks: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        splitter = SSESplitter(MAX)
        events = [e for c in chunks for e in splitter.feed(c)]
        return events, splitter.flush()

    one, one_tail = run([stream])
    many, many_tail = run(cut(stream, points))
    assert (many, many_tail) == (one, one_tail)
    rest = stream[len(b"".join(one)) :]
    assert stream.startswith(b"".join(one))
    assert one_tail == ([rest + b"\n\n"] if rest.strip(b"\r\n") else [])
    for event in one:
        assert re.search(rb"(\r\n|\r|\n)(\r\n|\r|\n)\Z", event), event


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
@pytest.mark.parametrize("read", [1 << 10, 1 << 14])
def test_a_long_event_is_scanned_in_linear_time(
    monkeypatch: pytest.MonkeyPatch, ending: bytes, read: int
) -> None:
    # Rejoining and rescanning the unfinished event on every read was quadratic: seconds of
    # event-loop time for one 16 MiB event. Count the bytes the scanners look at instead of
    # timing anything.
    scanned = 0

    def counting(fn):  # type: ignore[no-untyped-def]
        def wrapper(buf: bytes):  # type: ignore[no-untyped-def]
            nonlocal scanned
            scanned += len(buf)
            return fn(buf)

        return wrapper

    for name in ("_split_lf", "_split_general", "_may_end_event"):
        monkeypatch.setattr(sse, name, counting(getattr(sse, name, lambda b: True)))
    line = b"data: " + b"x" * 1000 + ending
    event = line * 1024 + ending  # 1 MiB, many lines
    small = b"data: after" + ending + ending
    stream = event + small
    splitter = SSESplitter(2 << 20)
    out = [e for i in range(0, len(stream), read) for e in splitter.feed(stream[i : i + read])]
    assert out == [event, small]
    # Each read once (with 3 bytes before it), the event once when it ends, and the rescans
    # of an event still under the parking threshold.
    assert scanned < 2 * len(stream) + 4 * 4096 * (4096 // read + 1), scanned


@pytest.mark.parametrize(
    ("header", "number"),
    [
        (b"7-3", 3),
        (b" 7-0\n", 0),  # as a header value may come
        (None, None),
        (b"8-3", None),  # another generation's
        (b"7-", None),
        (b"-3", None),
        (b"7-x", None),
        (b"7-3-1", None),
        (b"7-" + b"9" * 13, None),  # a huge number is not an id of ours
        (b"9" * 21 + b"-3", None),
        (b"7-" + b"9" * 12, 999_999_999_999),  # the longest number that is one
        (b"\xff", None),
    ],
)
def test_the_proxys_event_ids_round_trip_and_anything_else_is_no_resume_point(
    header: bytes | None, number: int | None
) -> None:
    assert resumes_after(header, 7) == number
    assert resumes_after(event_id(7, 41), 7) == 41


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_the_proxys_id_is_the_last_line_of_the_event_in_the_events_own_line_endings(
    ending: bytes,
) -> None:
    event = b"event: delta" + ending + b"id: upstream-9" + ending + b"data: x" + ending + ending
    stamped = sse.with_id(event, event_id(7, 3))
    assert stamped == event[: -len(ending)] + b"id: 7-3" + ending + ending
    # Still one event, whatever the chunking, and a client's last id is the proxy's.
    assert split_all([stamped[:5], stamped[5:]]) == expected_after_flush([stamped])
    assert parse_fields(stamped) == {"event": "delta", "id": "7-3", "data": "x"}
    assert [d.last_event_id for d in reference_events(stamped)] == ["7-3"]


def test_a_generation_token_of_twenty_digits_is_the_longest_read() -> None:
    twenty, longer = int("9" * 20), int("9" * 21)
    assert resumes_after(b"%d-3" % twenty, twenty) == 3
    assert resumes_after(b"%d-3" % longer, longer) is None


@pytest.mark.parametrize("chunk", [b"\r\rdata: x\n\n", b"\r\r\n\n", b"\rdata: x\r\n\n"])
def test_a_read_that_begins_with_a_cr_splits_as_it_would_byte_by_byte(chunk: bytes) -> None:
    # The fast path (one whole event in one read) must not take a read with a CR anywhere,
    # at its first byte included: there a CR ends a line, and "\r\r" is an event of its own.
    whole = SSESplitter(MAX).feed(chunk)
    splitter, bytewise = SSESplitter(MAX), []
    for i in range(len(chunk)):
        bytewise += splitter.feed(chunk[i : i + 1])
    assert whole == bytewise
