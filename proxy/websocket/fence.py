"""Fencing per response over a Responses API WebSocket (CONTRACT section 8).

Each client `response.create` is an attempt, keyed like an HTTP body: the upgrade's turn
header, else the fingerprint of the message without its envelope (`type`, `stream_id`) and
volatile fields, scoped by the credential, so that the HTTP fallback of the same request
has the same key. Its lease comes from the shared registry, so a newer attempt over any
socket, or over HTTP, supersedes it.

The upstream interleaves the events of concurrent responses by lane (`stream_id`; requests
of one lane run in order), so an upstream event belongs to the oldest unfinished attempt of
its lane. A superseded attempt's client gets one `error` event (Responses dialect, with its
`stream_id`), and nothing of it after that. The protocol has no cancel message, so its
generation is stopped by closing the upstream socket; the next message opens a new one,
and attempts of that socket that had not started yet are sent again on it. When another
response of the socket is already streaming, closing would cut that one too: the socket is
kept and the superseded response's events are dropped until it ends (counted and logged).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import deque
from typing import Any

import anyio

from proxy.errors import RegistryUnavailable, StreamfenceError, Superseded
from proxy.ops.record import Outcome, Record, Source
from proxy.websocket.attempts import ResponseAttempt, TwinTable, twin_beside
from proxy.websocket.types import Data, FenceSession
from proxy.wire import dialects, health, turns, usage
from proxy.wire.sse import parse_fields
from proxy.wire.usage import Usage

CREATE = "response.create"
TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
# Envelope fields of a WebSocket message that an HTTP body of the same request does not have.
ENVELOPE = ("type", "stream_id")
CLOSE_UNSUPPORTED, CLOSE_POLICY = 1003, 1008
# What may end a response, or be a keep-alive (OpenAI's `keepalive`): only such messages and
# those that name a lane are parsed.
_WORTH_PARSING = re.compile(r'"(?:response\.(?:completed|failed|incomplete)|error|keepalive)"')


class FenceClose(Exception):
    """The client sent what cannot be relayed on this path: close with `code`."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class ResponsesFence:
    def __init__(self, session: FenceSession, twins: TwinTable) -> None:
        self.session = session
        self.rt = session.rt
        self.up = session.upgrade.route.upstream
        self.twins = twins
        self.lanes: dict[str | None, deque[ResponseAttempt]] = {}
        self._pending: ResponseAttempt | None = None  # the attempt of the event being written
        self._terminal = False
        self.resend: list[Data] = []  # unstarted messages to send on the next upstream

    # -- client messages -----------------------------------------------------------------

    async def admit(self, data: Data) -> None:
        """Checks one client message; a response.create becomes an attempt with a lease."""
        if isinstance(data, bytes):
            return  # not the Responses protocol: relayed, unfenced (the upstream answers)
        try:
            parsed: Any = json.loads(data)
        except (ValueError, RecursionError):
            raise FenceClose(CLOSE_UNSUPPORTED, "streamfence: messages must be JSON") from None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("type"), str):
            raise FenceClose(CLOSE_POLICY, "streamfence: a message must be an object with a type")
        if parsed["type"] != CREATE:
            return  # response.steer and types unknown to the proxy: the upstream decides
        lane = parsed.get("stream_id")
        attempt = ResponseAttempt(self._record(), data, lane if isinstance(lane, str) else None)
        attempt.owner = self
        attempt.record.model = _model(parsed, self.session.upgrade.route.path)
        self.rt.metrics.in_flight.inc()
        self.rt.begin(attempt)
        try:
            await self._claim(attempt, data)
        except RegistryUnavailable as exc:
            attempt.record.error = exc.code
            await self.session.send_client(self._error_frame(attempt, exc))
            self._finish(attempt, Outcome.REJECTED, exc)
            raise FenceClose(1013, "streamfence: the turn registry is unavailable") from exc
        # Only now: the attempt it supersedes (on this socket too) was fenced without it.
        self.lanes.setdefault(attempt.lane, deque()).append(attempt)

    async def _claim(self, attempt: ResponseAttempt, data: str) -> None:
        self.rt.metrics.generations.labels(self.up.name).inc()  # each goes upstream
        sess = self.session
        ignore = (*self.rt.config.turns.ignore_fields, *ENVELOPE)
        turn = turns.resolve(
            sess.upgrade.client_headers,
            sess.upgrade.query,
            data.encode("utf-8", "surrogatepass"),
            header_name=self.rt.turn_header,
            route=self.up.name,
            path=sess.upgrade.route.path,
            use_fingerprint=self.up.fingerprint,
            ignore_fields=ignore,
        )
        if turn is None:
            return
        attempt.record.turn = turn.short
        attempt.body_fp = turn.body_fingerprint or turns.fingerprint(
            self.up.name, sess.upgrade.route.path, data.encode("utf-8", "surrogatepass"), ignore
        )
        running = self.twins.running(turn.key)
        if running is not None and self._beside(running, attempt):
            # Beside, not following: a follower's later previous_response_id would name a
            # response its own upstream socket never saw (store=false: not found there).
            attempt.record.source = Source.BESIDE
            return  # forwarded beside the running twin: fences nobody, fenced by nobody
        attempt.lease = lease = await self.rt.registry.claim(turn.key)
        attempt.record.attempt = lease.attempt
        self.twins.current[turn.key] = attempt
        lease.on_superseded(lambda: self._superseded(attempt))

    def _beside(self, running: ResponseAttempt, attempt: ResponseAttempt) -> bool:
        identical = running.body_fp == attempt.body_fp
        healthy = health.healthy(running.alive_at, time.monotonic(), self.up.healthy_within)
        return twin_beside(identical, healthy, self.up.on_retry)

    def forward_failed(self) -> None:
        for attempt in self._live():
            if not attempt.done:
                self._finish(attempt, Outcome.UPSTREAM_ERROR)

    # -- upstream events -----------------------------------------------------------------

    def outgoing(self, data: Data) -> bool:
        """The fence check, right before the write: False drops the event."""
        self._pending, self._terminal = None, False
        if isinstance(data, bytes):
            return True
        if not self.lanes:
            return True  # no response in flight: nothing to attribute (steer answers...)
        lane: Any = None
        terminal = keepalive = False
        found: Usage | None = None
        # Most events are deltas of the one response in flight: only those that may end a
        # response or name a lane are parsed (a JSON string value "response.completed" keeps
        # its quotes unescaped; the same words inside a delta's text are escaped or bare).
        if _WORTH_PARSING.search(data) or '"stream_id"' in data:
            try:
                event: Any = json.loads(data)
            except (ValueError, RecursionError):
                return True  # not an event of a response: relayed as it came
            if not isinstance(event, dict):
                return True
            lane = event.get("stream_id")
            terminal = event.get("type") in TERMINAL
            if terminal:  # (what it cost: response.completed, .incomplete, .failed)
                found = usage.of_event(dialects.OPENAI_RESPONSES, event)
            keepalive = dialects.names_keepalive(dialects.OPENAI_RESPONSES, event.get("type"))
        queue = self.lanes.get(lane if isinstance(lane, str) else None)
        if not queue:
            return True
        attempt = queue[0]
        now = time.perf_counter()
        if not keepalive:
            attempt.alive_at = time.monotonic()
        if attempt.record.upstream_headers_at is None:
            attempt.record.upstream_headers_at = now
        attempt.started = True
        if attempt.fenced:
            attempt.record.dropped += 1
            if terminal:
                self._finish(attempt, Outcome.SUPERSEDED)
            return False
        self._pending, self._terminal = attempt, terminal
        attempt.last_event = data
        if terminal:
            attempt.record.usage = found
        return True

    def delivered(self) -> None:
        attempt = self._pending
        if attempt is None:
            return
        record = attempt.record
        record.events += 1
        if record.first_byte_at is None:
            record.first_byte_at = time.perf_counter()
        if self._terminal:
            self._finish(attempt, Outcome.COMPLETED)

    def upstream_lost(self) -> None:
        for attempt in self._live():
            self._finish(attempt, Outcome.SUPERSEDED if attempt.fenced else Outcome.UPSTREAM_ERROR)

    def client_write_timeout(self) -> None:
        for attempt in self._live():
            attempt.record.error = "client_write_timeout"
            self._finish(attempt, Outcome.CLIENT_GONE)

    def end_all(self) -> None:
        """The session is over: every attempt still open ends (its client left)."""
        for attempt in self._live():
            self._finish(attempt, Outcome.SUPERSEDED if attempt.fenced else Outcome.CLIENT_GONE)

    # -- fencing -------------------------------------------------------------------------

    def _superseded(self, attempt: ResponseAttempt) -> None:
        """The lease's callback, run in the claimer's task: fence at once."""
        if attempt.done or attempt.fenced:
            return
        attempt.fenced = True
        assert attempt.lease is not None
        attempt.record.superseded_by = attempt.lease.newer_attempt
        error = Superseded(attempt.lease.attempt, attempt.lease.newer_attempt)
        self._stop(attempt, error)

    def abort(self, attempt: ResponseAttempt, error: StreamfenceError) -> None:
        attempt.fenced = True
        self._stop(attempt, error)
        self.session.close_later(1001, "streamfence: shutting down")

    def _stop(self, attempt: ResponseAttempt, error: StreamfenceError) -> None:
        others = [a for a in self._live() if a is not attempt and not a.fenced]
        frame = self._error_frame(attempt, error)
        if any(a.started for a in others):
            self.session.spawn(self._tell, attempt, frame, False)
            return  # another response is streaming on this socket: drop this one's events
        self.session.retire_upstream_now()
        lease = attempt.lease
        if lease is not None and lease.superseded_at is not None:
            attempt.record.fence_latency = time.perf_counter() - lease.superseded_at
        self._discard(attempt)
        self.session.spawn(self._tell, attempt, frame, True)
        if others:  # queued behind it or in other lanes, not started: sent again
            self.resend = [a.message for a in others]
            self.session.spawn(self.session.forward, None)

    async def _tell(self, attempt: ResponseAttempt, frame: str, ended: bool) -> None:
        attempt.record.error = attempt.record.error or "stream_superseded"
        try:
            await self.session.send_client(frame)
        finally:
            if ended:
                outcome = (
                    Outcome.SUPERSEDED
                    if attempt.lease and attempt.lease.superseded
                    else Outcome.SHUTDOWN
                )
                self._finish(attempt, outcome)

    def _error_frame(self, attempt: ResponseAttempt, error: StreamfenceError) -> str:
        last = None if attempt.last_event is None else b"data: " + attempt.last_event.encode()
        sse = dialects.stream_error_frame(dialects.OPENAI_RESPONSES, error, last)
        frame: dict[str, Any] = json.loads(parse_fields(sse)["data"])
        if attempt.lane is not None:
            frame["stream_id"] = attempt.lane
        return json.dumps(frame, separators=(",", ":"), ensure_ascii=False)

    # -- bookkeeping ---------------------------------------------------------------------

    def _live(self) -> list[ResponseAttempt]:
        return [a for queue in self.lanes.values() for a in queue if not a.done]

    def _discard(self, attempt: ResponseAttempt) -> None:
        queue = self.lanes.get(attempt.lane)
        if queue is not None and attempt in queue:
            queue.remove(attempt)
            if not queue:
                del self.lanes[attempt.lane]

    def _finish(
        self, attempt: ResponseAttempt, outcome: Outcome, error: StreamfenceError | None = None
    ) -> None:
        if attempt.done:
            return
        attempt.done = True
        self._discard(attempt)
        record = attempt.record
        record.outcome = outcome
        record.finished_at = time.perf_counter()
        fenced = outcome == Outcome.SUPERSEDED  # each response was asked upstream
        self.rt.ledger.answered(record.upstream, record.model, record.usage, fenced, record.events)
        if attempt.lease is not None:
            self.twins.discard(attempt.lease.key, attempt)
        self.session.spawn(self._release, attempt, error)

    async def _release(self, attempt: ResponseAttempt, error: StreamfenceError | None) -> None:
        with anyio.CancelScope(shield=True):
            try:
                if attempt.lease is not None:
                    await self.rt.registry.release(attempt.lease)
            finally:
                self.rt.finished(attempt.record, error)
                self.rt.end(attempt)
                # Done with both, and both refer back to the attempt (the lease's callback,
                # the fence's last event): cycles only the garbage collector would free.
                if attempt.lease is not None:
                    attempt.lease.forget()
                attempt.owner = None

    def _record(self) -> Record:
        sess = self.session
        record = Record(method="WS", path=sess.upgrade.route.path, request_id=uuid.uuid4().hex)
        record.upstream, record.dialect = self.up.name, dialects.OPENAI_RESPONSES
        record.streaming, record.status = True, 101
        record.forwarded_at = record.started
        return record


def _model(message: dict[str, Any], path: str) -> str:
    """The model a response.create names: at its top level, or in its `response` object (the
    older shape)."""
    inner = message.get("response")
    return (
        usage.request_model(message, path)
        or (usage.request_model(inner, path) if isinstance(inner, dict) else None)
        or ""
    )
