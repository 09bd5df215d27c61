"""Following a generation log (`genlog`) from any process: `LogReader`, and what it reads.

A reader reads the stream with XREAD BLOCK from the last entry id it has seen, so the
catch-up and the live part are one loop with one cursor: nothing lost or doubled between
them. Every CHECK_EVERY a task of its own re-registers it (however slowly its batches are
consumed) and checks the writer's stamp against Redis's clock (`timing`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NamedTuple, TypeVar

from proxy.errors import GenerationLost, RegistryUnavailable
from proxy.registry.genlog.meta import End, Meta, Start
from proxy.registry.genlog.store import Store
from proxy.registry.genlog.timing import CHECK_EVERY, DEAD_AFTER, DETECT_WITHIN
from proxy.registry.redisio import patiently
from proxy.tasks import cancelled

READ_COUNT = 512  # entries per XREAD

T = TypeVar("T")


class Batch(NamedTuple):
    first: int  # the index of events[0] in the generation (0-based)
    events: list[bytes]


class LogReader:
    """An async iterator of `Batch`es; ends after the end marker (`outcome` then says
    which) or raises `GenerationLost`. Use `async with`, or call `aclose()`: it unregisters."""

    def __init__(
        self,
        store: Store,
        key: str,
        token: int,
        after: int | None,
        reader_id: str | None = None,
    ) -> None:
        self.store, self.key, self.token = store, key, token
        self.id = reader_id or uuid.uuid4().hex
        self.start: Start | None = None
        self.outcome: End | None = None
        self.meta: Meta | None = None
        self.checked_at = 0.0  # when `meta` was read (time.monotonic)
        self._keys = store.keys(key, token)
        self._last_id: bytes = b"0-0"
        self._next = 0 if after is None else after + 1  # the first index still wanted
        self._ready: deque[Batch] = deque()
        self._closed = False
        self._error: GenerationLost | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._answered_at = time.monotonic()  # Redis's last answer to this reader

    async def check(self) -> Meta:
        """Refresh the registration; raise if the log is gone or its writer stopped."""
        reader_id = "" if self._closed else self.id
        meta = await self._patiently(lambda: self.store.follow(self._keys, reader_id))
        if meta is None:
            raise GenerationLost("not_found" if self.meta is None else "lost", _MESSAGES["lost"])
        self.meta = meta
        self.checked_at = time.monotonic()
        if self.start is None:
            self.start = meta.start
        if not meta.writer_alive:
            raise GenerationLost("writer_gone", _MESSAGES["writer_gone"])
        return meta

    def keep_alive(self) -> None:
        """Re-register and check the writer every CHECK_EVERY, however slowly the batches
        are consumed (a slow client must not stop counting as a reader)."""

        async def run() -> None:
            while self.outcome is None:
                await asyncio.sleep(CHECK_EVERY)
                try:
                    await self.check()
                except GenerationLost as exc:
                    self._error = exc
                    return

        self._keepalive = asyncio.get_running_loop().create_task(run())

    async def wait_start(self) -> Start:
        """Until the generation's response status and headers are known."""
        while self.start is None:
            if self.outcome is not None:
                raise GenerationLost("lost", _MESSAGES["lost"])
            await self._pull()
        return self.start

    def __aiter__(self) -> LogReader:
        return self

    async def __anext__(self) -> Batch:
        while not self._ready:
            if self.outcome is not None:
                await self.aclose()
                raise StopAsyncIteration
            await self._pull()
        return self._ready.popleft()

    async def _pull(self) -> None:
        if self._error is not None:
            raise self._error
        block = int(CHECK_EVERY * 1000)
        stream, after = self._keys[0], self._last_id
        reply = await self._patiently(lambda: self.store.read(stream, after, READ_COUNT, block))
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self._last_id = entry_id
                self._take(fields)
                if self.outcome is not None:
                    return

    def _take(self, f: dict[bytes, bytes]) -> None:
        kind = f.get(b"k")
        if kind == b"b":
            first = int(f[b"i"])
            if first > self._next:  # trimmed before we read it, or lost in a restart
                raise GenerationLost("trimmed", _MESSAGES["trimmed"])
            data, at, events = f[b"d"], 0, []
            for n in map(int, f[b"l"].split(b",")):
                events.append(data[at : at + n])
                at += n
            skip = self._next - first
            if skip < len(events):
                self._ready.append(Batch(self._next, events[skip:]))
                self._next = first + len(events)
        elif kind == b"s" and self.start is None:
            pairs = json.loads(f[b"h"])
            self.start = Start(int(f[b"s"]), [tuple(h) for h in pairs])
        elif kind == b"e":
            outcome = End(f[b"o"].decode())
            if outcome is End.LOST:
                raise GenerationLost("lost", _MESSAGES["lost"])
            self.outcome = outcome

    async def _patiently(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call`; GenerationLost once Redis has not answered this reader for DETECT_WITHIN,
        as long as the silence that declares a writer dead."""
        try:
            reply = await patiently(
                call, "follow", answered_at=self._answered_at, within=DETECT_WITHIN
            )
        except RegistryUnavailable as exc:
            raise GenerationLost("unavailable", _MESSAGES["unavailable"]) from exc
        self._answered_at = time.monotonic()
        return reply

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._keepalive is not None:
            await cancelled([self._keepalive])
        await self.store.unregister(self._keys, self.id)

    async def __aenter__(self) -> LogReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


_MESSAGES = {
    "writer_gone": "streamfence: the process streaming this answer stopped sending it "
    f"(no sign of it for {DEAD_AFTER:g} s); retry to start a new generation",
    "lost": "streamfence: the shared log of this answer is gone (Redis restarted or evicted "
    "it); retry to start a new generation",
    "trimmed": "streamfence: the events asked for are no longer kept in the shared log; "
    "retry to start a new generation",
    "unavailable": "streamfence: the shared log of this answer cannot be read (Redis is "
    "unreachable); retry to start a new generation",
}
