"""The proxy endpoint: every request outside /_streamfence/. It reads the request, finds
its generation (a new one started, or a running one to follow) and hands it to its
subscriber (`proxy.turn.relay`). Errors raised before the relay starts are turned into responses
here, in one place, in the caller's dialect.
"""

from __future__ import annotations

import uuid
from typing import Any

from proxy.asgi import Receive, Send
from proxy.config.schema import EventIds, UpstreamConfig
from proxy.errors import BodyTooLarge, NoRoute, StreamfenceError, Unauthorized
from proxy.ops.record import Outcome, Record, Source, upstream_request_id
from proxy.runtime import Runtime
from proxy.turn.ask import Ask
from proxy.turn.generation import Generation
from proxy.turn.relay import Subscriber
from proxy.turn.table import NothingLeft
from proxy.turn.writes import Exchange, error_response_parts
from proxy.upstream import routing
from proxy.upstream.client import build_request
from proxy.upstream.routing import RESERVED_PREFIX, request_headers
from proxy.wire import dialects, turns, usage

REQUEST_ID_HEADER = b"x-request-id"
_ALWAYS, _AUTO = EventIds.ALWAYS, EventIds.AUTO  # bound once: see proxy/turn/rule.py NEW
LAST_EVENT_ID = b"last-event-id"


class ClientLeft(Exception):
    """The client disconnected while the proxy was still reading its request."""


class ProxyEndpoint:
    """Every path outside /_streamfence/: read the request, find its generation, relay it."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        rt = self.rt
        rt.metrics.in_flight.inc()
        raw_path = scope.get("raw_path") or scope["path"].encode()
        path = raw_path.decode("latin-1")
        query = scope.get("query_string", b"").decode("latin-1")
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        request_id = _request_id(headers)
        record = Record(method=scope["method"], path=scope["path"], request_id=request_id)
        record.dialect = dialects.detect(path)
        own = [(REQUEST_ID_HEADER, request_id.encode())]
        try:
            generation, exchange = await self._accept(path, query, headers, receive, record, own)
        except ClientLeft:
            record.outcome, record.source = Outcome.CLIENT_GONE, Source.REFUSED
            rt.finished(record, None)
            return
        except NothingLeft:
            # 204 also tells a browser's EventSource to stop reconnecting.
            record.outcome, record.status, record.source = Outcome.COMPLETED, 204, Source.RESUMED
            await send({"type": "http.response.start", "status": 204, "headers": own})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            rt.finished(record, None)
            return
        except StreamfenceError as exc:  # refused by the proxy itself: no upstream served it
            record.outcome, record.status, record.error = Outcome.REJECTED, exc.status, exc.code
            record.source = Source.REFUSED
            start, body = error_response_parts(exc, record.dialect, own)
            await send(start)
            await send(body)
            rt.finished(record, None)
            return

        def finished(record: Record, error: StreamfenceError | None) -> None:
            # Both ids in the log line: the caller's (or ours), and the upstream's, which
            # is what the client was given (relay: the upstream's own x-request-id wins).
            record.upstream_request_id = upstream_request_id(generation.raw_headers)
            rt.finished(record, error)

        subscriber = Subscriber(generation, exchange, record, finished)
        rt.begin(subscriber)
        try:
            await subscriber(scope, receive, send)
        finally:
            rt.end(subscriber)

    async def _accept(
        self,
        path: str,
        query: str,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
        record: Record,
        own: list[tuple[bytes, bytes]],
    ) -> tuple[Generation, Exchange]:
        """The request's generation (a new one started, or a running one to follow) and what
        its subscriber needs. Starting a generation is the last step: nothing may fail
        between it and the subscriber that owns it."""
        rt = self.rt
        if path == RESERVED_PREFIX or path.startswith(RESERVED_PREFIX + "/"):
            raise NoRoute("streamfence: no such endpoint under /_streamfence/")
        if not rt.authorized(headers):
            raise Unauthorized(
                "streamfence: this proxy needs its access token in the x-streamfence-token header"
            )
        query, query_turn = turns.split_query_turn(query, rt.config.turns.query_param)
        route = rt.router.route(path, query)
        up = route.upstream
        record.upstream = up.name
        record.dialect = dialects.detect(route.path, up.dialect)
        body = await _read_body(receive, headers, rt.config.server.max_body_bytes)
        turn = turns.resolve(
            headers,
            query,
            body,
            header_name=rt.turn_header,
            route=up.name,
            path=route.path,
            use_fingerprint=up.fingerprint,
            ignore_fields=rt.config.turns.ignore_fields,
            query_turn_id=query_turn,
        )
        record.turn = "" if turn is None else turn.short
        model = turn.model if turn is not None else usage.model_of(body, route.path)
        record.model = model or ""
        last_event_id = next((v for n, v in headers if n == LAST_EVENT_ID), None)

        def ask_for(keyed: bool, retired: frozenset[str]) -> Ask:
            return self._ask(up, route, record, turn, headers, body, keyed=keyed, retired=retired)

        assert rt.generations is not None
        placed = await rt.generations.place(turn, last_event_id, rt.policies[up.name], ask_for)
        if placed.refused:
            rt.metrics.follow_refused.labels(up.name, placed.refused).inc()
        if placed.started:
            rt.metrics.child(rt.metrics.generations, up.name).inc()
        record.source = placed.how
        timeout = rt.config.server.write_timeout
        exchange = Exchange(
            record.dialect, record.turn, placed.how, placed.started, placed.cursor, own, timeout
        )
        return placed.generation, exchange

    def _ask(
        self,
        up: UpstreamConfig,
        route: routing.Route,
        record: Record,
        turn: turns.TurnKey | None,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        keyed: bool,
        retired: frozenset[str],
    ) -> Ask:
        stamp = keyed and (
            up.event_ids == _ALWAYS or (up.event_ids == _AUTO and record.dialect == dialects.SSE)
        )
        # The proxy's own event ids replace the upstream's: a Last-Event-ID is one of ours.
        drop = self.rt.drop_headers | {LAST_EVENT_ID} if stamp else self.rt.drop_headers
        out_headers = request_headers(headers, drop)
        if not any(n == REQUEST_ID_HEADER for n, _ in out_headers):
            out_headers.append((REQUEST_ID_HEADER, record.request_id.encode()))
        if self.rt.tracer is not None:  # the request's span; upstream gets its
            out_headers = self.rt.tracer.start(record, headers, out_headers)  # traceparent
        followable = keyed and self.rt.policies[up.name].shares
        return Ask(
            request=build_request(record.method, route.url, out_headers, body, up),
            upstream=up.name,
            key=turn.key if keyed and turn is not None else None,
            body_hash=None if turn is None else turn.body_fingerprint,
            streaming=turn is not None and turn.streaming,
            max_event_bytes=up.max_event_bytes,
            buffer_bytes=up.join_buffer_bytes,
            stamp_ids=stamp,
            followable=followable,
            retain_for=up.replay_window if followable else 0.0,
            retired=retired,
            dialect=record.dialect,
            model=record.model or None,
        )


def _request_id(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == REQUEST_ID_HEADER and 0 < len(value) <= 128 and value.isascii():
            text = value.decode()
            if text.isprintable():
                return text
    return uuid.uuid4().hex


async def _read_body(receive: Receive, headers: list[tuple[bytes, bytes]], limit: int) -> bytes:
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise BodyTooLarge(f"streamfence: the request body is over the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"streamfence: the request body is over the {limit}-byte limit")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
