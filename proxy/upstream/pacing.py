"""When an upstream body is read in batches rather than as it comes: the decision, pure.

Why batches at all: with the upstream and the proxy on cores of their own, a proxy that
drains each write at once sleeps between them, so every write of the upstream pays a
wake-up across cores (costly, above all in a VM), the upstream slows to a few events per
wake-up, and both stay in that mode. Bench B2 (one fast stream) relayed at a third of its
rate in about half of its rounds that way, each small read also one write to the client.
Out of the poll for a moment, the socket gathers the writes without waking anyone and the
next read takes them all.

Only a body that has come in HOT_READS small reads in a row, each within HOT_GAP of the one
before, is paced: an LLM's tokens (milliseconds apart) and short responses (a few reads)
never are, and a stream that slows down is read as it comes again at its next read.
`proxy.upstream.connection.Connection` does the pausing; time is handed in, so this is testable
without a clock.
"""

from __future__ import annotations

from typing import Final

HOT_GAP: Final = 1e-3  # seconds: a read this soon after the one before is back to back
HOT_READS: Final = 4  # such small reads in a row before reading pauses
SMALL_READ: Final = 16 * 1024  # bytes: a read this big is a batch already
# How long reading pauses, so about the most an event of a paced body waits. libuv's timers
# count whole milliseconds, and uvloop rounds a delay to them: under half of one is no pause.
PAUSE: Final = 1e-3


class ReadPacer:
    """The reads of one response so far; tells after each whether to pause reading."""

    __slots__ = ("_hot", "_last")

    def __init__(self) -> None:
        self._hot = 0  # small reads back to back, in a row
        self._last = float("-inf")

    def pause_after(self, size: int, now: float) -> bool:
        """A read of `size` bytes came at `now`: should reading pause for PAUSE?"""
        back_to_back = size < SMALL_READ and now - self._last < HOT_GAP
        self._last = now
        if not back_to_back:
            self._hot = 0
            return False
        self._hot += 1
        return self._hot >= HOT_READS

    def resumed(self, now: float) -> None:
        """Reading resumed at `now`: a read that comes at once is still back to back, so a
        stream that keeps its pace stays paced."""
        self._last = now
