"""Turn streams: one upstream generation, buffered so that retries can join it.

For upstreams with `on_retry = "join"` or `"adaptive"`, each turn's upstream stream is a
`TurnStream`: a reader task owns the upstream response and appends its events, each given an
`id:` (1, 2, ... per stream), to a bounded buffer. Relays are consumers of that buffer. A retry
with the same body does not go upstream: it takes the stream over from the old attempt (which
is fenced exactly as under "supersede": still one writer per turn), receives every event so far
and then the live ones. `Last-Event-ID` resumes after that id. With `replay_window` > 0, a
finished stream stays for that long, so a retry just after the end is replayed from memory.

The stream belongs to its newest attempt (`owner`): when that attempt ends for any other reason
than being joined (client gone, superseded by a different body, shutdown), the upstream is
closed at once, as CONTRACT section 2 requires.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from proxy import upstream
from proxy.config import UpstreamConfig
from proxy.errors import StreamfenceError
from proxy.upstream import UpstreamClient

log = logging.getLogger("streamfence")


@dataclass(slots=True)
class Budget:
    """The byte cap over every buffered stream of the process."""

    total: int
    used: int = 0
    overflows: int = 0


def with_id(event: bytes, n: int) -> bytes:
    """`event` with an `id: n` line added last, so it wins over an upstream id of its own."""
    if event.endswith(b"\r\n"):
        end = b"\r\n"
    elif event.endswith(b"\n"):
        end = b"\n"
    else:
        end = b"\r"
    return event[: -len(end)] + b"id: " + str(n).encode() + end + end


class TurnStream:
    """One upstream generation of a turn, shared by the attempts that join it."""

    def __init__(
        self,
        key: str,
        body_hash: str,
        client: UpstreamClient,
        request: httpx.Request,
        upstream_name: str,
        max_event_bytes: int,
        buffers: StreamTable,
    ) -> None:
        self.key = key
        self.body_hash = body_hash
        self._client, self._request, self._name = client, request, upstream_name
        self._max_event_bytes = max_event_bytes
        self._table = buffers
        self.events: list[bytes] = []  # events[i] has id base + i + 1
        self.base = 0
        self.size = 0
        self.response: httpx.Response | None = None
        self.error: StreamfenceError | None = None
        self.is_sse = False
        self.done = False
        self.completed = False
        self.joinable = True
        self.owner: object | None = None
        self.owner_cursor = 0  # how far the owner has written; the buffer may drop below it
        self.last_activity = time.monotonic()
        self.headers_ready = asyncio.Event()
        self._changed = asyncio.Event()
        self._room = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- the reader ---------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            self.response = await self._client.send(self._request, self._name)
            self.last_activity = time.monotonic()
            self.is_sse = upstream.is_event_stream(self.response)
            self.headers_ready.set()
            if self.is_sse:
                self.completed = await upstream.read_events(
                    self.response, self._name, self._max_event_bytes, self._take
                )
        except StreamfenceError as exc:
            self.error = exc
        finally:
            self.done = True
            self.headers_ready.set()
            self._changed.set()

    async def _take(self, events: list[bytes]) -> bool:
        self._append(events)
        while not self.joinable and self.size > self._table.upstream.join_buffer_bytes:
            # Nobody can join any more: keep only what the owner has yet to write, and
            # let the owner's pace throttle the upstream (back-pressure).
            self._room.clear()
            await self._room.wait()
        return True

    def _append(self, events: list[bytes]) -> None:
        first = self.base + len(self.events) + 1
        stamped = [with_id(e, first + i) for i, e in enumerate(events)]
        self.events.extend(stamped)
        added = sum(map(len, stamped))
        self.size += added
        self._table.grew(self, added)
        self.last_activity = time.monotonic()
        self._changed.set()

    # -- the consumers ------------------------------------------------------------------
    def since(self, cursor: int) -> list[bytes]:
        """The buffered events after id `cursor`."""
        return self.events[cursor - self.base :] if cursor >= self.base else []

    @property
    def last_id(self) -> int:
        return self.base + len(self.events)

    async def wait(self, cursor: int) -> None:
        """Until there is an event after `cursor`, or the stream is done."""
        while cursor >= self.last_id and not self.done:
            self._changed.clear()
            await self._changed.wait()

    def written(self, owner: object, cursor: int) -> None:
        if owner is not self.owner:
            return
        self.owner_cursor = cursor
        if not self.joinable:
            self._trim()

    def overflow(self) -> None:
        """Over a cap: from now on a retry supersedes; the buffer keeps only unwritten events."""
        if self.joinable:
            self.joinable = False
            log.warning(
                '{"msg": "join buffer over its cap: retries of this turn will supersede",'
                ' "turn": "%s"}',
                self.key[:16],
            )
            self._trim()

    def _trim(self) -> None:
        drop = max(0, self.owner_cursor - self.base)
        if drop:
            freed = sum(map(len, self.events[:drop]))
            del self.events[:drop]
            self.base += drop
            self.size -= freed
            self._table.shrank(freed)
        self._room.set()

    async def close(self) -> None:
        """Close the upstream now; nothing is drained."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.response is not None:
            await self.response.aclose()
        self.done = True
        self._changed.set()

    def free(self) -> None:
        self._table.shrank(self.size)
        self.events, self.size = [], 0


class StreamTable:
    """The streams of one process, by turn key, under a global byte cap."""

    def __init__(self, upstream: UpstreamConfig, budget: Budget) -> None:
        self.upstream = upstream  # on_retry, healthy_within, replay_*, join_buffer_bytes
        self.budget = budget
        self._streams: dict[str, TurnStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def find(self, key: str, body_hash: str, *, explicit: bool, resume: bool) -> TurnStream | None:
        """The stream a retry may take over, or None when it must supersede."""
        stream = self._streams.get(key)
        if stream is None or stream.body_hash != body_hash or not stream.joinable:
            return None
        if stream.error is not None or (stream.headers_ready.is_set() and not stream.is_sse):
            return None
        if stream.done and not stream.completed:
            return None
        if stream.owner is None:  # over for its client: a replay, inside replay_window only
            allowed = explicit or resume or self.upstream.replay_fingerprints
            return stream if allowed else None
        if self.upstream.on_retry == "adaptive" and not stream.done:
            quiet = time.monotonic() - stream.last_activity
            return stream if quiet <= self.upstream.healthy_within else None
        return stream

    def new(self, stream: TurnStream) -> None:
        old = self._streams.get(stream.key)
        if old is not None and old.done:
            self._forget(old)
        self._streams[stream.key] = stream

    def ended(self, stream: TurnStream) -> None:
        """The owner is done with `stream`: keep it for replay_window if it completed."""
        if self._streams.get(stream.key) is not stream:
            stream.free()
            return
        window = self.upstream.replay_window
        if stream.completed and stream.joinable and window > 0:
            asyncio.get_running_loop().call_later(window, self._expire, stream)
        else:
            self._forget(stream)

    def _expire(self, stream: TurnStream) -> None:
        if self._streams.get(stream.key) is stream and stream.owner is None:
            self._forget(stream)

    def _forget(self, stream: TurnStream) -> None:
        if self._streams.get(stream.key) is stream:
            del self._streams[stream.key]
        stream.free()

    def grew(self, stream: TurnStream, added: int) -> None:
        budget = self.budget
        budget.used += added
        if stream.joinable and (
            stream.size > self.upstream.join_buffer_bytes or budget.used > budget.total
        ):
            budget.overflows += 1
            stream.overflow()

    def shrank(self, freed: int) -> None:
        self.budget.used -= freed
