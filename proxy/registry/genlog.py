"""The generation log: a generation's events in Redis, so that a process other than the one
holding its upstream can follow it (from the start, or after an event index, then live).

Per generation (turn K, token T), three keys under K's hash tag (one slot, so every script
is one round trip, on one server or a cluster):
    streamfence:{K}:gen:T          a Redis Stream: 'o' opened, 's' started (status, headers),
                                   'b' batch (the complete events of one upstream read:
                                   first index, lengths, bytes), 'e' end (outcome)
    streamfence:{K}:gen:T:meta     a hash: body hash, streaming mode, status, headers, `at`
                                   (the writer's last stamp), `last` (last upstream byte),
                                   `ended`
    streamfence:{K}:gen:T:readers  a sorted set: reader id -> expiry (Redis's clock)

Why Streams, not pub/sub plus a list: a follower must read what was sent before it came
and then the live events with nothing lost or doubled between the two. A Stream gives both
from one key with one cursor (XREAD BLOCK from the last id seen), trimmed by MAXLEN ~ and
expired like any key; pub/sub would need a subscription per follower, a separate list for
the catch-up, and a handover between them that can drop or repeat a batch; and a cluster
keeps a Stream on its slot's node while plain pub/sub fans every message out to every node.
Measured on this 2-core machine (bench/genlog.py, loopback): see the README's Redis section.

Liveness: the writer stamps `at` with every write and at least every HEARTBEAT (1 s). A
reader checks every CHECK_EVERY (0.5 s), with Redis's own clock, and raises
`GenerationLost("writer_gone")` once the stamp is older than DEAD_AFTER (2 s): a dead
writer is detected within DETECT_WITHIN = 3 s, never a hang. The same check re-registers
the reader (READER_TTL 3 s), so the writer's stamps return how many readers any process
still has (`LogWriter.readers`), and a crashed reader stops counting after 3 s.

Failures never reach the writer's caller: a write that Redis refuses (unreachable, OOM
under maxmemory) or a log Redis lost (restarted, evicted) marks the writer `broken`; it stops
publishing and its generation carries on locally. Readers get `GenerationLost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from proxy.errors import GenerationLost, RegistryUnavailable
from proxy.registry.connection import COMMAND_TIMEOUT, PREFIX, Client, Keys, translate
from proxy.registry.logscripts import CURRENT, FOLLOW, OPEN, READERS, WRITE

log = logging.getLogger("streamfence")

HEARTBEAT = 1.0
DEAD_AFTER = 2.0
CHECK_EVERY = 0.5
DETECT_WITHIN = DEAD_AFTER + 2 * CHECK_EVERY  # a check, then a blocked read returning
READER_TTL = 3.0
MAXLEN = 10_000  # batches kept per generation (approximate: whole macro nodes go)
TTL = 30.0  # a running log's keys live this long after its writer's last stamp
LINGER = 60.0  # an ended log's keys, for late resumes and replays
MAX_PENDING = 8 << 20  # bytes queued for Redis before the writer gives up (Redis too slow)
READ_COUNT = 512  # entries per XREAD
OUTCOMES = ("completed", "failed", "superseded")


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
    since_write: float  # seconds since the writer's last stamp (Redis's clock)
    since_activity: float  # seconds since the later of the request and its last batch

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
            since_write=(now_ms - int(m["at"])) / 1000,
            since_activity=(now_ms - int(m["last"])) / 1000,
        )

    @property
    def writer_alive(self) -> bool:
        return self.ended is not None or self.since_write <= DEAD_AFTER


class Current(NamedTuple):
    token: int
    attempt: int
    meta: Meta | None  # None: the holder publishes no log (or it expired)


class GenerationLog:
    def __init__(
        self, client: Client, *, maxlen: int = MAXLEN, ttl: float = TTL, linger: float = LINGER
    ) -> None:
        self.client = client
        self.maxlen = maxlen
        self.ttl_ms = int(ttl * 1000)
        self.linger_ms = int(linger * 1000)
        self._open = client.register_script(OPEN)
        self._write = client.register_script(WRITE)
        self._follow = client.register_script(FOLLOW)
        self._current = client.register_script(CURRENT)
        self._readers = client.register_script(READERS)

    @staticmethod
    def keys(key: str, token: int) -> list[str]:
        base = f"{PREFIX}{{{key}}}:gen:{token}"
        return [base, base + ":meta", base + ":readers"]

    async def open(self, key: str, token: int, *, body_hash: str, streaming: bool) -> LogWriter:
        """Start publishing generation `token` of `key`; raises `RegistryUnavailable`."""
        with translate("open log"):
            args: list[str | int] = [self.ttl_ms, self.maxlen, body_hash, "1" if streaming else "0"]
            await self._open(keys=self.keys(key, token), args=args)
        return LogWriter(self, key, token)

    async def follow(self, key: str, token: int, after: int | None = None) -> LogReader:
        """A registered reader of the log: batches from the start, or after event index
        `after`. Raises `GenerationLost` if there is no such log or its writer is gone."""
        reader = LogReader(self, key, token, after)
        await reader.check()
        reader.keep_alive()
        return reader

    async def current(self, key: str) -> Current | None:
        """The turn's current holder and its log's meta: one round trip."""
        prefix = f"{PREFIX}{{{key}}}:gen:"
        with translate("current"):
            reply = await self._current(keys=[Keys.entry(key)], args=[prefix])
        if len(reply) < 3:
            return None
        meta = Meta.parse(int(reply[0]), reply[3]) if reply[3] else None
        return Current(int(reply[1]), int(reply[2]), meta)

    async def readers(self, key: str, token: int) -> int:
        """Readers registered on any process (and not expired)."""
        with translate("readers"):
            return int(await self._readers(keys=[self.keys(key, token)[2]]))


class _Write(NamedTuple):
    kind: str  # '' heartbeat, 's' started, 'b' batch, 'e' end
    meta: list[Any]  # field pairs for the meta hash
    entry: list[Any]  # field pairs for the stream entry


class LogWriter:
    """Publishes one generation. `started`/`append` only queue (the relay never waits on
    Redis); one task sends, coalescing what queued up meanwhile into one batch."""

    def __init__(self, log: GenerationLog, key: str, token: int) -> None:
        self.log, self.key, self.token = log, key, token
        self.readers = 0  # readers registered on any process, as of the last write
        self.broken = False  # Redis failed or lost the log: nothing more is published
        self._keys = log.keys(key, token)
        self._queue: deque[_Write] = deque()
        self._next = 0  # index of the next event appended
        self._pending = 0  # bytes queued
        self._ending = False
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued, nothing being sent
        self._idle.set()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"streamfence-log-{key[:8]}"
        )

    def started(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        pairs = json.dumps([list(h) for h in headers])
        self._put(_Write("s", ["status", status, "headers", pairs], ["s", status, "h", pairs]))

    def append(self, events: Sequence[bytes]) -> None:
        """Queue the complete events of one upstream read."""
        if not events or self.broken or self._ending:
            return
        first = self._next
        self._next += len(events)
        self._pending += sum(map(len, events))
        if self._pending > MAX_PENDING:
            self._give_up("Redis is not keeping up")
            return
        last = self._queue[-1] if self._queue else None
        if last is not None and last.kind == "b":  # coalesce: still one round trip
            last.entry[1].extend(events)
        else:
            self._put(_Write("b", [], [first, list(events)]))

    async def end(self, outcome: str) -> None:
        """Write the end marker (completed / failed / superseded) and stop; waits at most
        about one command timeout, whatever Redis does."""
        assert outcome in OUTCOMES, outcome
        if not self._ending:
            self._put(_Write("e", ["ended", outcome], ["o", outcome]))
            self._ending = True
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._task), COMMAND_TIMEOUT * 2)
        await self.abort()

    async def abort(self) -> None:
        """Stop publishing without an end: readers see the writer gone (DETECT_WITHIN)."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._idle.set()

    async def flushed(self) -> None:
        """Until everything queued so far has been sent (or the writer gave up)."""
        await self._idle.wait()

    def _put(self, write: _Write) -> None:
        if not self.broken and not self._ending:
            self._queue.append(write)
            self._idle.clear()
            self._wake.set()

    def _give_up(self, why: str) -> None:
        if not self.broken:
            log.warning(
                "streamfence: turn %s: no longer publishing its generation to Redis (%s); "
                "it continues in this process",
                self.key[:16],
                why,
            )
        self.broken = True
        self._queue.clear()
        self._wake.set()
        self._idle.set()

    async def _run(self) -> None:
        while not self.broken:
            if not self._queue:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), HEARTBEAT)
            self._wake.clear()
            write = self._queue.popleft() if self._queue else _Write("", [], [])
            try:
                with translate("publish"):
                    count = int(await self._send(write))
            except RegistryUnavailable as exc:
                self._give_up(exc.message)
                return
            if count < 0:
                self._give_up("Redis lost the log (restarted, or evicted it)")
                return
            self.readers = count
            if not self._queue:
                self._idle.set()
            if write.kind == "e":
                return

    async def _send(self, write: _Write) -> Any:
        entry = write.entry
        ttl = self.log.linger_ms if write.kind == "e" else self.log.ttl_ms
        meta = list(write.meta)
        if write.kind == "b":
            first, events = entry
            self._pending -= sum(map(len, events))
            meta += ["next", first + len(events)]
            entry = ["i", first, "l", ",".join(str(len(e)) for e in events), "d", b"".join(events)]
        args = [ttl, self.log.maxlen, write.kind, len(meta) // 2, *meta, *entry]
        return await self.log._write(keys=self._keys, args=args)


class LogReader:
    """An async iterator of `Batch`es; ends after the end marker (`outcome` then says
    which) or raises `GenerationLost`. Use `async with`, or call `aclose()`: it unregisters."""

    def __init__(self, log: GenerationLog, key: str, token: int, after: int | None) -> None:
        self.log, self.key, self.token = log, key, token
        self.id = uuid.uuid4().hex
        self.start: Start | None = None
        self.outcome: str | None = None
        self.meta: Meta | None = None
        self._keys = log.keys(key, token)
        self._last_id: bytes = b"0-0"
        self._next = 0 if after is None else after + 1  # the first index still wanted
        self._ready: deque[Batch] = deque()
        self._closed = False
        self._error: GenerationLost | None = None
        self._keepalive: asyncio.Task[None] | None = None

    async def check(self) -> Meta:
        """Refresh the registration; raise if the log is gone or its writer stopped."""
        with self._lost("unavailable"):
            reply = await self.log._follow(
                keys=self._keys,
                args=[
                    "" if self._closed else self.id,
                    int(READER_TTL * 1000),
                    self.log.ttl_ms,
                ],
            )
        if len(reply) < 2:
            raise GenerationLost("not_found" if self.meta is None else "lost", _MESSAGES["lost"])
        self.meta = meta = Meta.parse(int(reply[0]), reply[1:])
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
        with self._lost("unavailable"):
            reply: Any = await self.log.client.xread(
                {self._keys[0]: self._last_id}, count=READ_COUNT, block=int(CHECK_EVERY * 1000)
            )
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
            outcome = f[b"o"].decode()
            if outcome == "lost":
                raise GenerationLost("lost", _MESSAGES["lost"])
            self.outcome = outcome

    @contextlib.contextmanager
    def _lost(self, reason: str) -> Iterator[None]:
        try:
            with translate("follow"):
                yield
        except RegistryUnavailable as exc:
            raise GenerationLost(reason, _MESSAGES[reason]) from exc

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
