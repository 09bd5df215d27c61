"""Join, resume and replay: the relay for upstreams with `on_retry = "join" | "adaptive"`.

`JoinRelay` is the ordinary relay (same race, same fence, same frames) whose events come from
a `TurnStream` buffer instead of straight from the upstream response. A retry whose body is
identical to the in-flight attempt's takes the stream over: it claims a newer lease, so the
old attempt is fenced exactly as under "supersede", but the upstream is not closed and not
asked again. Whoever owns the stream when it ends for another reason closes the upstream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import anyio

from proxy.errors import StreamfenceError, UpstreamError
from proxy.logs import Record
from proxy.registry import Registry
from proxy.relay import Exchange, Relay, Send
from proxy.turnstream import StreamTable, TurnStream
from proxy.upstream import UpstreamClient


class JoinPlan(NamedTuple):
    """What a request to a join/adaptive upstream brings to its relay."""

    table: StreamTable  # the upstream's streams, by turn
    body_hash: str  # the body's canonical hash: what "an identical retry" means
    last_event_id: int | None  # Last-Event-ID: where to resume, if anywhere


class JoinRelay(Relay):
    def __init__(
        self,
        exchange: Exchange,
        client: UpstreamClient,
        registry: Registry | None,
        record: Record,
        on_finish: Callable[[Record, StreamfenceError | None], None],
        plan: JoinPlan,
    ) -> None:
        super().__init__(exchange, client, registry, record, on_finish)
        self.table, self.body_hash, self.last_event_id = plan
        self.stream: TurnStream | None = None
        self.cursor = 0

    def _new_stream(self) -> TurnStream:
        assert self.ex.turn is not None
        stream = TurnStream(
            self.ex.turn.key,
            self.body_hash,
            self.client,
            self.ex.request,
            self.ex.upstream_name,
            self.ex.max_event_bytes,
            self.table,
        )
        self.table.new(stream)
        self.record.source, self.cursor = "upstream", 0
        return stream

    async def _claim(self, fence: anyio.CancelScope) -> None:
        turn = self.ex.turn
        assert turn is not None
        resume = self.last_event_id is not None
        stream = self.table.find(
            turn.key, self.body_hash, explicit=turn.source == "header", resume=resume
        )
        if stream is None:
            stream = self._new_stream()
        else:
            replay = stream.owner is None
            self.record.source = "replayed" if replay else "resumed" if resume else "joined"
            self.cursor = min(self.last_event_id or 0, stream.last_id)
        # Owned before the claim fences the old attempt, so that it leaves the upstream open.
        previous, stream.owner = stream.owner, self
        try:
            await super()._claim(fence)
        except BaseException:
            stream.owner = previous
            raise
        if stream.done and not stream.completed:  # closed under us: generate anew
            stream.owner = None
            self.table.ended(stream)
            stream = self._new_stream()
            stream.owner = self
        self.stream = stream

    async def _open(self) -> None:
        stream = self.stream
        assert stream is not None
        if self.record.source == "upstream":
            self.record.forwarded_at = time.perf_counter()
            stream.start()
        await stream.headers_ready.wait()
        if stream.response is None:
            raise stream.error or UpstreamError("streamfence: the upstream request ended early")
        self.response = stream.response
        self.record.upstream_headers_at = time.perf_counter()
        self.record.status = stream.response.status_code

    def _is_sse(self) -> bool:
        return self.stream is not None and self.stream.is_sse

    async def _relay_events(self, send: Send) -> None:
        stream = self.stream
        assert stream is not None
        self.record.streaming = True
        await self._start(send, reframed=True)
        cursor = self.cursor
        while True:
            await stream.wait(cursor)
            events = stream.since(cursor)
            if not events:
                break  # done, everything written
            if not await self._deliver(send, events):
                return
            cursor += len(events)
            stream.written(self, cursor)
        if stream.error is not None:
            raise stream.error
        if not stream.completed:
            raise UpstreamError("streamfence: the upstream stream was closed before its end")
        self.completed = True

    async def _close_upstream(self) -> None:
        stream = self.stream
        if stream is None or stream.owner is not self:
            return  # joined by a newer attempt: the stream is its now
        stream.owner = None
        if not stream.completed:
            with anyio.CancelScope(shield=True):
                await stream.close()
        self.response = None
        self.table.ended(stream)
