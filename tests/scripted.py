"""A scripted upstream provider: a real HTTP server on 127.0.0.1, port 0.

Each request's behaviour comes from a `Script`: by default from the JSON body's "script"
object (clients pass it with `extra_body`), else from `ScriptedUpstream.choose` (for clients
that cannot add a field, such as agents started as processes), else the next one of
`ScriptedUpstream.queue` (one per request, in arrival order: for clients whose retries resend
byte-identical bodies), else `ScriptedUpstream.default`. Every
request is recorded as a `Seen`, with events a test can wait on: `gate` holds the stream
between events until the test releases it, and `closed` is set the moment the server sees
its client (the proxy) go away, with `events_sent` telling how far it got.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn

Scope = dict[str, Any]


@dataclass
class Script:
    tokens: int | list[str] = 3
    delay: float = 0.0  # seconds between events
    gated: bool = False  # wait for Seen.release() before each event after the first
    # Like gated, but from the event after the one carrying token number n (1-based) on:
    # the client has text in hand (a Responses or Anthropic stream announces its message
    # in events before the first token).
    gated_after_tokens: int | None = None
    hold_headers: bool = False  # wait for Seen.release() before sending headers
    status: int = 200
    stream: bool | None = None  # None: from the request body's "stream"
    fail_after: int | None = None  # break the connection after this many events
    raw: list[str] | None = None  # exact SSE text to send instead of generated events
    raw_bytes: list[bytes] | None = None
    prefix: str = ""  # token prefix, so two attempts' texts are told apart
    # Prefix the tokens with this request's number as well ("g<n>:"): identical requests
    # that reach the upstream (new generations of one turn) still answer apart.
    unique: bool = False
    headers: dict[str, str] = field(default_factory=dict)  # extra response headers
    body: str | None = None  # a whole (non-SSE) body to send instead of the generated JSON
    content_type: str = "application/json"  # of `body`
    json_body: Any = (
        None  # the whole JSON body of a non-streaming answer, instead of the generated one
    )
    # A keep-alive block (exact SSE text) sent every `keepalive_every` seconds while the
    # stream waits on its gate, and once between two events `delay` apart: a stream that
    # stalls (or pauses) behind keep-alives, as OpenRouter's, Anthropic's and sse-starlette
    # servers do. Not counted in `events_sent`.
    keepalive: str | None = None
    keepalive_every: float = 0.1
    # Token usage to report, in each dialect's own shape and place (input, output,
    # cached_input, reasoning: proxy/wire/usage.py), and the model the answer names.
    usage: dict[str, int] | None = None
    model: str = "m"

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Script | None:
        raw = body.get("script")
        if not isinstance(raw, dict):
            return None
        return cls(**raw)

    def token_list(self) -> list[str]:
        if isinstance(self.tokens, list):
            return self.tokens
        return [f"{self.prefix}{i} " for i in range(self.tokens)]


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    script: Script
    opened_at: float = field(default_factory=time.perf_counter)
    events_sent: int = 0
    closed_at: float | None = None
    finished: bool = False
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    broke: bool = False  # the script broke the connection itself (fail_after)
    over: asyncio.Event = field(default_factory=asyncio.Event)  # handler returned, any reason
    sent_event: asyncio.Event = field(default_factory=asyncio.Event)
    keepalives_sent: int = 0
    pinged: asyncio.Event = field(default_factory=asyncio.Event)  # set at each keep-alive
    _permits: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(0))

    def __repr__(self) -> str:
        # Short, so that a failed assertion on a list of requests stays readable.
        state = "closed" if self.closed.is_set() else "finished" if self.finished else "open"
        return f"<Seen {self.method} {self.path} events_sent={self.events_sent} {state}>"

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._permits.release()

    async def wait_sent(self, n: int) -> None:
        """Until the server has written at least n events."""
        while self.events_sent < n:
            self.sent_event.clear()
            await self.sent_event.wait()

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class ScriptedUpstream:
    def __init__(self) -> None:
        self.default = Script()
        self.queue: collections.deque[Script] = collections.deque()
        # (path, parsed body) -> Script, or None for the default
        self.choose: Callable[[str, Any], Script | None] | None = None
        self.seen: list[Seen] = []
        self.arrived = asyncio.Event()
        self.url = ""

    async def wait_requests(self, n: int) -> list[Seen]:
        while len(self.seen) < n:
            self.arrived.clear()
            await self.arrived.wait()
        return self.seen

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        try:
            parsed = json.loads(body) if body else {}
        except ValueError:
            parsed = {}
        script = Script.from_body(parsed) if isinstance(parsed, dict) else None
        if script is None and self.choose is not None:
            script = self.choose(scope["path"], parsed)
        if script is None:
            script = self.queue.popleft() if self.queue else self.default
        if script.unique:
            script = dataclasses.replace(script, prefix=f"{script.prefix}g{len(self.seen)}:")
        seen = Seen(
            method=scope["method"],
            path=scope["path"],
            query=scope["query_string"].decode(),
            headers={k.decode(): v.decode() for k, v in scope["headers"]},
            body=body,
            script=script,
        )
        self.seen.append(seen)
        self.arrived.set()
        task = asyncio.current_task()
        assert task is not None

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not seen.finished:
                seen.closed_at = time.perf_counter()
                seen.closed.set()
                task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await self._respond(seen, parsed, send)
            seen.finished = True
        except asyncio.CancelledError:
            if not seen.closed.is_set():
                raise
        finally:
            watcher.cancel()
            seen.over.set()

    async def _respond(self, seen: Seen, body: Any, send: Any) -> None:
        script = seen.script
        if script.hold_headers:
            await seen._permits.acquire()
        streaming = (
            script.stream
            if script.stream is not None
            # Gemini says it by the method in the path, not in the body.
            else bool(isinstance(body, dict) and body.get("stream"))
            or ":streamGenerateContent" in seen.path
        )
        if script.status >= 400:
            payload = json.dumps({"error": {"message": "scripted failure", "type": "scripted"}})
            await _send_whole(send, script.status, payload.encode(), "application/json", script)
            return
        if script.body is not None:
            await _send_whole(send, 200, script.body.encode(), script.content_type, script)
            return
        if not streaming:
            whole = (
                script.json_body if script.json_body is not None else _whole_response(seen, script)
            )
            payload = json.dumps(whole)
            await _send_whole(send, 200, payload.encode(), "application/json", script)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]
                + _extra(script),
            }
        )
        gate_from = 1 if script.gated else None
        if script.gated_after_tokens is not None:
            gate_from = _token_offset(seen.path, script) + script.gated_after_tokens
        for i, event in enumerate(_events(seen.path, script)):
            if gate_from is not None and i >= gate_from:
                await _gate(seen, send)
            elif i > 0 and script.delay:
                await _pause(seen, send, script.delay)
            if script.fail_after is not None and i >= script.fail_after:
                seen.broke = True
                raise ConnectionAbortedError("scripted break")  # uvicorn drops the connection
            await send({"type": "http.response.body", "body": event, "more_body": True})
            seen.events_sent += 1
            seen.sent_event.set()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _keepalive(seen: Seen, send: Any) -> None:
    assert seen.script.keepalive is not None
    body = seen.script.keepalive.encode()
    await send({"type": "http.response.body", "body": body, "more_body": True})
    seen.keepalives_sent += 1
    seen.pinged.set()


async def _gate(seen: Seen, send: Any) -> None:
    """Until the test releases the next event; keep-alives meanwhile, if scripted."""
    if seen.script.keepalive is None:
        await seen._permits.acquire()
        return
    while True:
        try:
            await asyncio.wait_for(seen._permits.acquire(), seen.script.keepalive_every)
            return
        except TimeoutError:
            await _keepalive(seen, send)


async def _pause(seen: Seen, send: Any, delay: float) -> None:
    """`delay` between two events, a keep-alive halfway through if scripted."""
    if seen.script.keepalive is None:
        await asyncio.sleep(delay)
        return
    await asyncio.sleep(delay / 2)
    await _keepalive(seen, send)
    await asyncio.sleep(delay / 2)


def _extra(script: Script) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in script.headers.items()]


async def _send_whole(send: Any, status: int, body: bytes, ctype: str, script: Script) -> None:
    headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
    headers += _extra(script)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _whole_response(seen: Seen, script: Script) -> dict[str, Any]:
    body = _whole_body(seen, script)
    u = script.usage
    if u is not None:  # each API's own shape, as its non-streaming answer carries it
        if ":generateContent" in seen.path:
            body["usageMetadata"] = {
                "promptTokenCount": u.get("input", 0),
                "candidatesTokenCount": u.get("output", 0),
            }
        elif seen.path.endswith("/responses"):
            body["usage"] = _responses_usage(u)
        elif seen.path.endswith("/messages"):
            body["usage"] = {"input_tokens": u.get("input", 0), "output_tokens": u.get("output", 0)}
        else:
            body["usage"] = _chat_usage(u)
    return body


def _whole_body(seen: Seen, script: Script) -> dict[str, Any]:
    text = "".join(script.token_list())
    if ":generateContent" in seen.path:
        return {
            "candidates": [
                {"content": {"parts": [{"text": text}], "role": "model"}, "finishReason": "STOP"}
            ],
            "modelVersion": script.model,
        }
    if seen.path.endswith("/responses"):
        return {
            "id": "resp_1",
            "object": "response",
            "created_at": 1,
            "model": script.model,
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
    if seen.path.endswith("/messages"):
        return {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": script.model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": script.model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "path": seen.path,
        "method": seen.method,
    }


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def _events(path: str, script: Script) -> list[bytes]:
    if script.raw_bytes is not None:
        return script.raw_bytes
    if script.raw is not None:
        return [e.encode() for e in script.raw]
    tokens = script.token_list()
    if path.endswith("/responses"):
        return _responses_events(tokens, script)
    if path.endswith("/messages"):
        return _anthropic_events(tokens, script)
    if ":streamGenerateContent" in path:
        return _gemini_events(tokens, script)
    return _chat_events(tokens, script)


def _gemini_events(tokens: list[str], script: Script) -> list[bytes]:
    chunks: list[dict[str, Any]] = [
        {"candidates": [{"content": {"parts": [{"text": t}], "role": "model"}}]} for t in tokens
    ]
    u = script.usage
    if u is not None and chunks:
        chunks[-1]["usageMetadata"] = {
            "promptTokenCount": u.get("input", 0),
            "candidatesTokenCount": u.get("output", 0) - u.get("reasoning", 0),
            "thoughtsTokenCount": u.get("reasoning", 0),
            "cachedContentTokenCount": u.get("cached_input", 0),
        }
        chunks[-1]["modelVersion"] = script.model
    return [_sse(c) for c in chunks]


def _token_offset(path: str, script: Script) -> int:
    """How many events of a generated stream come before its first token."""
    if script.raw is not None or script.raw_bytes is not None:
        return 0
    if path.endswith("/responses"):
        return 3  # response.created, output_item.added, content_part.added
    if path.endswith("/messages"):
        return 2  # message_start, content_block_start
    return 0


def _chat_events(tokens: list[str], script: Script) -> list[bytes]:
    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **more: Any) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1}
        return _sse({**body, "model": script.model, "choices": choices, **more})

    u = script.usage
    # As OpenAI sends it with stream_options.include_usage: "usage": null in every chunk,
    # then a last chunk with no choices and the counts.
    nulls = {} if u is None else {"usage": None}
    out = [chunk({"content": t}, **nulls) for t in tokens] + [chunk({}, "stop", **nulls)]
    if u is not None:
        out.append(chunk(None, usage=_chat_usage(u)))
    return [*out, b"data: [DONE]\n\n"]


def _chat_usage(u: dict[str, int]) -> dict[str, Any]:
    return {
        "prompt_tokens": u.get("input", 0),
        "completion_tokens": u.get("output", 0),
        "total_tokens": u.get("input", 0) + u.get("output", 0),
        "prompt_tokens_details": {"cached_tokens": u.get("cached_input", 0)},
        "completion_tokens_details": {"reasoning_tokens": u.get("reasoning", 0)},
    }


def _responses_events(tokens: list[str], script: Script) -> list[bytes]:
    # The event sequence the Responses API sends for one text message (the Vercel AI SDK
    # needs the item and content part announced before their deltas).
    response = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": script.model,
        "status": "in_progress",
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    item = {"type": "message", "id": "msg_1", "status": "in_progress", "role": "assistant"}
    text = "".join(tokens)
    part = {"type": "output_text", "text": "", "annotations": []}
    done_part = {**part, "text": text}
    done_item = {**item, "status": "completed", "content": [done_part]}
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    bodies: list[dict[str, Any]] = [
        {"type": "response.created", "response": response},
        {"type": "response.output_item.added", "output_index": 0, "item": {**item, "content": []}},
        {"type": "response.content_part.added", **where, "part": part},
        *(
            {"type": "response.output_text.delta", **where, "delta": t, "logprobs": []}
            for t in tokens
        ),
        {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **where, "part": done_part},
        {"type": "response.output_item.done", "output_index": 0, "item": done_item},
        {
            "type": "response.completed",
            "response": {
                **response,
                "status": "completed",
                "output": [done_item],
                **({} if script.usage is None else {"usage": _responses_usage(script.usage)}),
            },
        },
    ]
    return [_sse({**b, "sequence_number": i}, b["type"]) for i, b in enumerate(bodies)]


def _responses_usage(u: dict[str, int]) -> dict[str, Any]:
    return {
        "input_tokens": u.get("input", 0),
        "input_tokens_details": {"cached_tokens": u.get("cached_input", 0)},
        "output_tokens": u.get("output", 0),
        "output_tokens_details": {"reasoning_tokens": u.get("reasoning", 0)},
        "total_tokens": u.get("input", 0) + u.get("output", 0),
    }


def _anthropic_events(tokens: list[str], script: Script) -> list[bytes]:
    u = script.usage or {"input": 1, "output": len(tokens)}
    cached = u.get("cached_input", 0)  # Anthropic's input_tokens leave the cache reads out
    start_usage = {
        "input_tokens": u.get("input", 0) - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": 1,
    }
    message: dict[str, object] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": script.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": start_usage,
    }
    out = [
        _sse({"type": "message_start", "message": message}, "message_start"),
        _sse(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            "content_block_start",
        ),
    ]
    out += [
        _sse(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}},
            "content_block_delta",
        )
        for t in tokens
    ]
    out += [
        _sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        _sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": u.get("output", len(tokens))},
            },
            "message_delta",
        ),
        _sse({"type": "message_stop"}, "message_stop"),
    ]
    return out


def free_port() -> int:
    """A loopback port nobody listens on now (bound, then closed): for servers started in
    another process, and for a "connection refused" upstream."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def serve(app: Any, **config: Any) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    """Run `app` under real uvicorn on 127.0.0.1, port 0, in the current event loop."""
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it a write after the headers waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    options: dict[str, Any] = dict(
        lifespan="on",
        log_level="warning",
        http="httptools",
        ws="none",
        timeout_graceful_shutdown=2,
        # Longer than httpx's 5 s keep-alive expiry: with equal timeouts a client can pick a
        # pooled connection in the instant the server closes it (a ReadError before any
        # response), which in a long stress run happens to some request sooner or later.
        timeout_keep_alive=30,
        access_log=False,
        server_header=False,
        date_header=False,
    )
    options.update(config)
    server = uvicorn.Server(uvicorn.Config(app, **options))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.002)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        await task
        sock.close()
