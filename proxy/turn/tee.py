"""A generation's tee: besides its clients, what takes a copy of its answer as it is read.

The table gives each generation it publishes for other processes the maker of its tee
(`proxy.turn.table.Generations.start`): the generation log's writer
(`proxy.registry.genlog.writer.LogWriter`), made once the generation holds its turn, whose
token names the log. From then on the tee is attached as a client is: the generation tells
it its start (status and headers), the events of every read and its end, and never waits for
it on the per-event path. The tee knows no generation; the generation knows its tee only by
this interface.

The tee also says whether anyone reads through it elsewhere, and when a generation's upstream
closes for want of clients is decided here, in turn/, with that answer (`hold`): once no
client of this process reads it, its upstream stays open while other processes still do,
and closes when none does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from proxy.registry.genlog.meta import End
from proxy.registry.genlog.timing import HEARTBEAT

log = logging.getLogger("streamfence")

# How often a held generation asks its tee again: the writer recounts the log's readers at
# least every HEARTBEAT (with its writes, or its heartbeat); asking more often learns nothing.
RECHECK = HEARTBEAT


class Tee(Protocol):
    """What a generation tells its tee. `started` and `append` never wait."""

    broken: bool  # it gave up (its store failed): nothing more is published, nobody reads it

    def started(self, status: int, headers: Sequence[tuple[str, str]]) -> None: ...

    def append(self, events: Sequence[bytes], content: bool = True) -> None:
        """The events of one upstream read; `content`: not keep-alives only (what keeps a
        generation healthy, proxy.wire.health)."""

    async def end(self, outcome: End) -> None: ...

    async def readers_elsewhere(self) -> int:
        """How many read through it in other processes. When none, nobody may start to
        now (until `reopen`)."""

    def reopen(self) -> None:
        """Others may start to read through it again: the generation carries on."""


# The tee of generation `token` of a turn, made once the generation holds its turn (a log is
# named by its token): what the table gives a generation it publishes.
TeeFor = Callable[[int], Tee]


class Held(Protocol):
    """A generation no client of this process reads any more, as `hold` sees it."""

    done: bool  # its reader has finished
    finished: asyncio.Event  # ... and its upstream is closed

    def watched(self) -> bool: ...  # a client in this process reads it (again)

    async def close_for_want_of_clients(self) -> None: ...


async def hold(generation: Held, tee: Tee) -> None:
    """No client of `generation` is left in this process: its upstream stays open while
    other processes read it through `tee`, and closes once none does (readers are counted
    with a TTL: a crashed process's stop counting within a few seconds)."""
    try:
        while True:
            readers = await tee.readers_elsewhere()
            if generation.watched():  # a client here again: the last one to leave decides
                if not readers:
                    tee.reopen()
                return
            if generation.done or not readers:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(generation.finished.wait(), RECHECK)
    except Exception:  # whatever went wrong, the upstream and the lease must not leak
        log.exception("streamfence: counting a generation's readers elsewhere failed")
    if not generation.watched():
        await generation.close_for_want_of_clients()
