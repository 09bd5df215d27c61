"""Following a generation log (`genlog`) from any process: `LogReader`, and what it reads.

A reader reads the stream with XREAD BLOCK from the last entry id it has seen, so the
catch-up and the live part are one loop with one cursor: nothing lost or doubled between
them. Every CHECK_EVERY a task of its own re-registers it (however slowly its batches are
consumed) and checks the writer's stamp against Redis's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from redis.asyncio.cluster import RedisCluster

from proxy.errors import GenerationLost, RegistryUnavailable
from proxy.registry.redisio import patiently, translate

if TYPE_CHECKING:
    from proxy.registry.genlog.log import GenerationLog

DEAD_AFTER = 2.0  # a writer whose stamp is older than this (Redis's clock) is gone
CHECK_EVERY = 0.5  # a reader re-registers and checks the writer this often
DETECT_WITHIN = DEAD_AFTER + 2 * CHECK_EVERY  # a check, then a blocked read returning
READER_TTL = 3.0  # a reader that stops refreshing is not counted after this
READ_COUNT = 512  # entries per XREAD


class Start(NamedTuple):
    status: int
    headers: list[tuple[str, str]]


class Batch(NamedTuple):
    first: int  # the index of events[0] in the generation (0-based)
    events: list[bytes]


@dataclass(frozen=True, slots=True)
class Meta:
    body_hash: str
    streaming: bool
    start: Start | None
    ended: str | None  # an outcome once the end marker is written
    events: int  # events published so far
    since_write: float  # seconds since the writer's last stamp (Redis's clock)
    # Seconds since the later of the request, the response headers and the last batch with
    # content (proxy.wire.health: keep-alives do not count), by Redis's clock.
    since_activity: float

    @classmethod
    def parse(cls, now_ms: int, pairs: Sequence[bytes]) -> Meta:
        m = {pairs[i].decode(): pairs[i + 1].decode() for i in range(0, len(pairs) - 1, 2)}
        start = None
        if "status" in m:
            start = Start(int(m["status"]), [tuple(h) for h in json.loads(m["headers"])])
        return cls(
            body_hash=m.get("body", ""),
            streaming=m.get("mode") == "1",
            start=start,
            ended=m.get("ended"),
            events=int(m.get("next", 0)),
            since_write=(now_ms - int(m["at"])) / 1000,
            since_activity=(now_ms - int(m["last"])) / 1000,
        )

    @property
    def writer_alive(self) -> bool:
        return self.ended is not None or self.since_write <= DEAD_AFTER


class LogReader:
    """An async iterator of `Batch`es; ends after the end marker (`outcome` then says
    which) or raises `GenerationLost`. Use `async with`, or call `aclose()`: it unregisters."""

    def __init__(
        self,
        log: GenerationLog,
        key: str,
        token: int,
        after: int | None,
        reader_id: str | None = None,
    ) -> None:
        self.log, self.key, self.token = log, key, token
        self.id = reader_id or uuid.uuid4().hex
        self.start: Start | None = None
        self.outcome: str | None = None
        self.meta: Meta | None = None
        self.checked_at = 0.0  # when `meta` was read (time.monotonic)
        self._keys = log.keys(key, token)
        self._last_id: bytes = b"0-0"
        self._next = 0 if after is None else after + 1  # the first index still wanted
        self._ready: deque[Batch] = deque()
        self._closed = False
        self._error: GenerationLost | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._answered_at = time.monotonic()  # Redis's last answer to this reader

    async def check(self) -> Meta:
        """Refresh the registration; raise if the log is gone or its writer stopped."""
        args: list[str | int] = ["" if self._closed else self.id, int(READER_TTL * 1000)]
        args.append(self.log.ttl_ms)
        reply = await self._patiently(lambda: self.log._follow(keys=self._keys, args=args))
        if len(reply) < 2:
            raise GenerationLost("not_found" if self.meta is None else "lost", _MESSAGES["lost"])
        self.meta = meta = Meta.parse(int(reply[0]), reply[1:])
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
        reply = await self._patiently(self._xread)
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self._last_id = entry_id
                self._take(fields)
                if self.outcome is not None:
                    return

    async def _xread(self) -> Any:
        client, stream = self.log.reads, self._keys[0]
        block = int(CHECK_EVERY * 1000)
        if not isinstance(client, RedisCluster):
            return await client.xread({stream: self._last_id}, count=READ_COUNT, block=block)
        await client.initialize()  # the slot map (once; a no-op after)
        # Named node: the cluster client would otherwise ask a node for XREAD's keys
        # (COMMAND GETKEYS) before every read, a second round trip.
        args = ("COUNT", READ_COUNT, "BLOCK", block, "STREAMS", stream, self._last_id)
        node = client.get_node_from_key(stream)
        return await client.execute_command("XREAD", *args, target_nodes=node)

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
            outcome = f[b"o"].decode()
            if outcome == "lost":
                raise GenerationLost("lost", _MESSAGES["lost"])
            self.outcome = outcome

    async def _patiently(self, call: Callable[[], Awaitable[Any]]) -> Any:
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
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
        with contextlib.suppress(RegistryUnavailable), translate("unregister"):
            await self.log.client.zrem(self._keys[2], self.id)

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
