"""proxy/upstream/pacing.py: which reads of an upstream body pause reading, decided from sizes and
times handed in (no clock, no socket). proxy.upstream.connection's part is in test_transport.py."""

from __future__ import annotations

from proxy.upstream.pacing import HOT_GAP, HOT_READS, SMALL_READ, ReadPacer

SMALL = 200  # one token event in its chunk
STEP = HOT_GAP / 10  # reads back to back


def _reads(pacer: ReadPacer, times: list[float], size: int = SMALL) -> list[bool]:
    return [pacer.pause_after(size, t) for t in times]


def test_small_reads_back_to_back_pause_once_there_have_been_enough() -> None:
    pauses = _reads(ReadPacer(), [i * STEP for i in range(HOT_READS + 5)])
    # The first read has nobody before it; the next HOT_READS count up; from then on, every
    # read pauses while the stream keeps its pace.
    assert pauses == [False] * HOT_READS + [True] * 5


def test_a_short_response_never_pauses() -> None:
    # head, an event, the end: three reads back to back, as a one-token answer comes
    assert _reads(ReadPacer(), [0.0, STEP, 2 * STEP]) == [False, False, False]


def test_a_paced_stream_never_pauses() -> None:
    # An LLM's tokens: milliseconds apart, however many
    assert not any(_reads(ReadPacer(), [i * HOT_GAP * 1.5 for i in range(200)]))


def test_big_reads_never_pause_and_one_ends_a_run_of_small_ones() -> None:
    pacer = ReadPacer()
    assert not any(_reads(pacer, [i * STEP for i in range(50)], size=SMALL_READ))
    assert _reads(pacer, [1 + i * STEP for i in range(HOT_READS + 1)])[-1] is True
    assert pacer.pause_after(SMALL_READ, 1 + (HOT_READS + 1) * STEP) is False
    # the run starts over: the next small reads build up again before a pause
    again = _reads(pacer, [1 + (HOT_READS + 2 + i) * STEP for i in range(HOT_READS)])
    assert again == [False] * (HOT_READS - 1) + [True]


def test_after_a_pause_a_read_at_once_pauses_again_and_a_late_one_does_not() -> None:
    pacer = ReadPacer()
    assert _reads(pacer, [i * STEP for i in range(HOT_READS + 1)])[-1] is True
    resumed = 1.0  # long after the last read: the pause's own length is not a gap
    pacer.resumed(resumed)
    assert pacer.pause_after(SMALL, resumed + STEP) is True
    pacer.resumed(2.0)
    assert pacer.pause_after(SMALL, 2.0 + HOT_GAP * 2) is False  # the stream slowed down
    assert pacer.pause_after(SMALL, 2.0 + HOT_GAP * 2 + STEP) is False
