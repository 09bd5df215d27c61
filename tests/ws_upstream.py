"""A scripted upstream that speaks the Responses API's WebSocket mode: a real `websockets`
server on 127.0.0.1, port 0.

Each `response.create` is answered with response.created, output_item.added, one
output_text.delta per token, output_item.done and response.completed (each with its
`stream_id` when the request had one; requests of one lane run in order, as upstream).
The behaviour of a response comes from the message's "script" object, or its
`metadata["script"]` (a JSON string, for clients that only send known fields): see `Script`.
`previous_response_id` resolves as OpenAI's does: a stored response (store not false), or the
last response completed on the same connection; else an `error` previous_response_not_found.
Every connection and every response is recorded, with events a test can wait on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response


@dataclass
class Script:
    tokens: int | list[str] = 3
    delay: float = 0.0
    gated: bool = False  # wait for Gen.release() before each event after response.created
    prefix: str = ""
    close_code: int | None = None  # the server closes the socket after response.created
    abort: bool = False  # the server drops the TCP connection after response.created
    error: str | None = None  # answer with an `error` event of this code instead
    # While gated, OpenAI's keep-alive event ({"type": "keepalive", ...}) this often: a
    # response that stalls behind keep-alives. Not counted in `events_sent`.
    keepalive_every: float | None = None

    def token_list(self) -> list[str]:
        if isinstance(self.tokens, list):
            return self.tokens
        return [f"{self.prefix}{i} " for i in range(self.tokens)]


@dataclass
class Gen:
    """One response generated upstream."""

    id: str
    request: dict[str, Any]
    conn: Conn
    script: Script
    events_sent: int = 0
    keepalives_sent: int = 0
    pinged: asyncio.Event = field(default_factory=asyncio.Event)  # set at each keep-alive
    finished: bool = False
    cut: bool = False  # its connection closed before it finished
    over: asyncio.Event = field(default_factory=asyncio.Event)
    _permits: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(0))

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._permits.release()


@dataclass
class Conn:
    path: str
    headers: Headers
    subprotocol: str | None = None
    messages: list[Any] = field(default_factory=list)  # as received (str or bytes)
    last_completed: str | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    close_code: int | None = None
    close_reason: str = ""


class WsUpstream:
    def __init__(self) -> None:
        self.url = ""  # http://127.0.0.1:port: what the proxy is configured with
        self.conns: list[Conn] = []
        self.gens: list[Gen] = []
        self.stored: set[str] = set()
        self.refuse: tuple[int, dict[str, str], bytes] | None = None
        self.echo = False  # every message is sent back as it came (the relay tests)
        # The script of a request that names none itself (agents send what they send).
        self.choose: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self._ids = itertools.count(1)
        self._new_gen = asyncio.Condition()
        self._new_conn = asyncio.Condition()

    async def wait_gens(self, n: int) -> list[Gen]:
        async with self._new_gen:
            await self._new_gen.wait_for(lambda: len(self.gens) >= n)
        return self.gens

    async def wait_conns(self, n: int) -> list[Conn]:
        async with self._new_conn:
            await self._new_conn.wait_for(lambda: len(self.conns) >= n)
        return self.conns

    def process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        if self.refuse is None:
            return None
        status, headers, body = self.refuse
        response = conn.respond(status, "")
        response.body = body
        response.headers = Headers(
            {**headers, "Content-Length": str(len(body)), "Connection": "close"}
        )
        return response

    async def handler(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        conn = Conn(ws.request.path, ws.request.headers, ws.subprotocol)
        async with self._new_conn:
            self.conns.append(conn)
            self._new_conn.notify_all()
        lanes: dict[str | None, asyncio.Queue[dict[str, Any]]] = {}
        workers: list[asyncio.Task[None]] = []
        try:
            async for message in ws:
                conn.messages.append(message)
                if self.echo:
                    await ws.send(message)
                    continue
                request = json.loads(message)
                lane = request.get("stream_id")
                if lane not in lanes:
                    lanes[lane] = asyncio.Queue()
                    workers.append(asyncio.create_task(self._lane(ws, conn, lanes[lane])))
                lanes[lane].put_nowait(request)
        except ConnectionClosed:
            pass
        finally:
            for task in workers:
                task.cancel()
            for task in workers:
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                    await task
            if ws.close_code is not None:
                conn.close_code, conn.close_reason = ws.close_code, ws.close_reason or ""
            for gen in self.gens:
                if gen.conn is conn and not gen.finished:
                    gen.cut = True
                    gen.over.set()
            conn.closed.set()

    async def _lane(self, ws: ServerConnection, conn: Conn, queue: asyncio.Queue[Any]) -> None:
        while True:
            request = await queue.get()
            await self._respond(ws, conn, request)

    async def _respond(self, ws: ServerConnection, conn: Conn, request: dict[str, Any]) -> None:
        if request.get("type") != "response.create":
            error = _error("unknown_event_type", f"Unknown event type {request.get('type')!r}")
            await ws.send(json.dumps(error))
            return
        raw = request.get("script") or json.loads(
            (request.get("metadata") or {}).get("script", "{}")
        )
        if not raw and self.choose is not None:
            raw = self.choose(request)
        script = Script(**raw)
        lane = request.get("stream_id")
        gen = Gen(f"resp_{next(self._ids)}", request, conn, script)
        async with self._new_gen:
            self.gens.append(gen)
            self._new_gen.notify_all()
        seq = itertools.count()

        async def emit(event: dict[str, Any]) -> None:
            event["sequence_number"] = next(seq)
            if lane is not None:
                event["stream_id"] = lane
            await ws.send(json.dumps(event))
            gen.events_sent += 1

        previous = request.get("previous_response_id")
        if script.error or (
            previous is not None and previous not in self.stored and previous != conn.last_completed
        ):
            code = script.error or "previous_response_not_found"
            await emit(_error(code, f"Previous response with id '{previous}' not found."))
            gen.finished = True
            gen.over.set()
            return
        response = _response(gen.id, request, "in_progress", [])
        await emit({"type": "response.created", "response": response})
        if script.close_code is not None:
            await ws.close(script.close_code, "scripted close")
            return
        if script.abort:
            ws.transport.abort()
            return
        item: dict[str, Any] = {
            "id": f"msg_{gen.id}",
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        await emit({"type": "response.output_item.added", "output_index": 0, "item": item})
        text = ""
        for token in script.token_list():
            while script.gated:
                try:
                    await asyncio.wait_for(gen._permits.acquire(), script.keepalive_every)
                    break
                except TimeoutError:
                    await ws.send(json.dumps({"type": "keepalive", "sequence_number": next(seq)}))
                    gen.keepalives_sent += 1
                    gen.pinged.set()
            if script.delay:
                await asyncio.sleep(script.delay)
            text += token
            await emit(
                {
                    "type": "response.output_text.delta",
                    "item_id": item["id"],
                    "output_index": 0,
                    "content_index": 0,
                    "delta": token,
                    "logprobs": [],
                }
            )
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = {**item, "status": "completed", "content": [part]}
        await emit({"type": "response.output_item.done", "output_index": 0, "item": item})
        done = _response(gen.id, request, "completed", [item])
        await emit({"type": "response.completed", "response": done})
        conn.last_completed = gen.id
        if request.get("store") is not False:
            self.stored.add(gen.id)
        gen.finished = True
        gen.over.set()


def _response(rid: str, request: dict[str, Any], status: str, output: list[Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": 1,
        "model": request.get("model", "m"),
        "status": status,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "previous_response_id": request.get("previous_response_id"),
        "usage": {
            "input_tokens": 1,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": len(output),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 1 + len(output),
        },
    }


def _error(code: str, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "status": 400,
        "error": {"type": "invalid_request_error", "code": code, "message": message, "param": None},
    }


@asynccontextmanager
async def ws_upstream() -> AsyncIterator[WsUpstream]:
    upstream = WsUpstream()
    async with serve(
        upstream.handler, "127.0.0.1", 0, process_request=upstream.process_request
    ) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        upstream.url = f"http://127.0.0.1:{port}"
        yield upstream
