"""The benchmark's load client: raw asyncio sockets and httptools' response parser.

Run in its own process, one scenario against one target:

    python -m bench.client '{"kind": "ttft", "port": P, "n": 300}'

and prints one JSON object with the measurements. It counts SSE events by their blank-line
terminators and times their arrival; it never parses JSON, so it stays cheap next to the
process it measures. All times are time.monotonic(), one clock for every process on the
machine, so B5 can compare the client's send time with the upstream's close time.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import httptools

from bench.loop import run_fast

PATH = b"/v1/chat/completions"
CONNECT_SLOTS = 64  # concurrent connects in flight, so B4 does not overflow listen backlogs


@dataclass
class Result:
    status: int = 0
    events: int = 0
    sent_at: float = 0.0
    first_at: float = 0.0
    done_at: float = 0.0
    gaps: list[float] = field(default_factory=list)
    error: str = ""
    last: bytes = b""  # the body's last chunk: what a stream that fell short ended with


class Conn(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.result = Result()
        self.done: asyncio.Future[Result] | None = None
        self.first: asyncio.Future[None] | None = None
        self.gaps = False
        self.last_at = 0.0
        self.tail = b""
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(f"parse: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish("connection closed before the response ended")
        if not self.closed.done():
            self.closed.set_result(None)

    def _finish(self, error: str = "") -> None:
        if self.first is not None and not self.first.done():
            self.first.set_result(None)
        if self.done is not None and not self.done.done():
            self.result.error = error
            self.result.done_at = time.monotonic()
            self.done.set_result(self.result)

    def on_status(self, status: bytes) -> None:
        self.result.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.result.last = body  # a reference, not a copy: free on the hot path
        n = body.count(b"\n\n")
        if self.tail == b"\n" and body[:1] == b"\n":
            n += 1
        self.tail = body[-1:]
        if n:
            now = time.monotonic()
            r = self.result
            if not r.events:
                r.first_at = now
                if self.first is not None and not self.first.done():
                    self.first.set_result(None)
            elif self.gaps:
                r.gaps.append(now - self.last_at)
                r.gaps.extend([0.0] * (n - 1))
            self.last_at = now
            r.events += n

    def on_message_complete(self) -> None:
        self._finish()

    def request(
        self, tokens: int, delay_ms: int, rid: str, turn: str | None = None, gaps: bool = False
    ) -> asyncio.Future[Result]:
        assert self.transport is not None
        body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"bench %s"}]}' % (
            rid.encode()
        )
        head = [
            b"POST %s HTTP/1.1" % PATH,
            b"host: 127.0.0.1",
            b"content-type: application/json",
            b"content-length: %d" % len(body),
            b"x-bench-tokens: %d" % tokens,
            b"x-bench-delay-ms: %d" % delay_ms,
            b"x-bench-id: %s" % rid.encode(),
            b"x-request-id: %s" % rid.encode(),  # names it in the proxy's log too
        ]
        if turn is not None:
            head.append(b"x-turn-id: %s" % turn.encode())
        self.result = Result(sent_at=time.monotonic())
        self.gaps = gaps
        self.tail = b""
        self.done = asyncio.get_running_loop().create_future()
        self.first = asyncio.get_running_loop().create_future()
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        return self.done

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def connect(port: int, slots: asyncio.Semaphore | None = None) -> Conn:
    loop = asyncio.get_running_loop()
    if slots is None:
        _, conn = await loop.create_connection(Conn, "127.0.0.1", port)
        return conn
    async with slots:
        _, conn = await loop.create_connection(Conn, "127.0.0.1", port)
        return conn


async def one_stream(
    port: int,
    tokens: int,
    delay_ms: int,
    rid: str,
    slots: asyncio.Semaphore,
    gaps: bool = False,
    on_first: Callable[[], None] | None = None,
) -> Result:
    try:
        conn = await connect(port, slots)
    except OSError as exc:
        return Result(error=f"connect: {exc}")
    try:
        done = conn.request(tokens, delay_ms, rid, gaps=gaps)
        if on_first is not None:
            assert conn.first is not None
            conn.first.add_done_callback(lambda _: on_first())
        return await done
    finally:
        conn.close()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(results: list[Result], expect_events: int) -> dict[str, Any]:
    ok = [r for r in results if not r.error and r.status == 200 and r.events == expect_events]
    bad = [r for r in results if r not in ok]
    errors = sorted({r.error or f"status {r.status}, {r.events} events" for r in bad})
    return {"requests": len(results), "completed": len(ok), "errors": errors[:5]}


async def ttft(spec: dict[str, Any]) -> dict[str, Any]:
    """B1: sequential one-token streams over one keep-alive connection."""
    conn = await connect(spec["port"])
    results = []
    for i in range(spec["n"]):
        results.append(await conn.request(1, 0, f"{spec['tag']}-{i}"))
    conn.close()
    ms = [(r.first_at - r.sent_at) * 1000 for r in results if r.events]
    return {**_summary(results, 3), "ttft_ms": ms}


async def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    """B2: one stream of many events, no pacing."""
    conn = await connect(spec["port"])
    r = await conn.request(spec["tokens"], 0, f"{spec['tag']}-0")
    conn.close()
    seconds = r.done_at - r.sent_at
    return {**_summary([r], spec["tokens"] + 2), "events": r.events, "seconds": seconds}


async def _load(
    spec: dict[str, Any], slots: asyncio.Semaphore, on_first: Callable[[], None] | None = None
) -> list[Result]:
    tasks = [
        one_stream(
            spec["port"],
            spec["tokens"],
            spec["delay_ms"],
            f"{spec['tag']}-{i}",
            slots,
            gaps=True,
            on_first=on_first,
        )
        for i in range(spec["n"])
    ]
    return await asyncio.gather(*tasks)


async def concurrent(spec: dict[str, Any]) -> dict[str, Any]:
    """B3 and B4: many concurrent paced streams, each on its own connection."""
    start = time.monotonic()
    results = await _load(spec, asyncio.Semaphore(CONNECT_SLOTS))
    wall = time.monotonic() - start
    gaps = [g for r in results for g in r.gaps]
    return {
        **_summary(results, spec["tokens"] + 2),
        "wall_s": wall,
        "gap_p50_ms": _pct(gaps, 0.50) * 1000,
        "gap_p99_ms": _pct(gaps, 0.99) * 1000,
    }


async def _supersede(
    port: int, tag: str, slots: asyncio.Semaphore, close_only: bool
) -> tuple[str, float, bool]:
    """One supersede: a long attempt, and once its first event is in, a newer one.

    With `close_only` (targets without a fence: direct, nginx) the client closes the old
    connection itself instead: the same signal path, for the floor to compare with."""
    old_id, turn = f"{tag}-old", f"{tag}-turn"
    old = await connect(port, slots)
    pending = old.request(10_000, 20, old_id, turn)
    assert old.first is not None
    waits: list[asyncio.Future[Any]] = [old.first, pending]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if close_only:
        sent_at = time.monotonic()
        old.close()
        return old_id, sent_at, old.result.events > 0
    new = await connect(port, slots)
    sent_at = time.monotonic()
    newer = await new.request(1, 0, f"{tag}-new", turn)
    new.close()
    old_result = await asyncio.wait_for(pending, 10)
    old.close()
    # The old stream must end early: not with all its tokens.
    ok = newer.status == 200 and not old_result.error and old_result.events < 10_000
    return old_id, sent_at, ok


async def fence(spec: dict[str, Any]) -> dict[str, Any]:
    """B5: supersedes under the B3 load; latency to the old upstream connection's close.

    The supersedes start once every load stream has its first event (under the load, not
    during its ramp-up of 200 connects) and are open-loop: the j-th starts at its own time,
    `interval_ms / lanes` after the one before, whether or not earlier ones have finished.
    (Closed-loop lanes that fall behind fire at once and fall into step: ten supersedes
    arriving together, which measured the bench's own bunching.)"""
    slots = asyncio.Semaphore(CONNECT_SLOTS)
    waiting = spec["load"]["n"]
    established = asyncio.Event()

    def first_event() -> None:
        nonlocal waiting
        waiting -= 1
        if waiting == 0:
            established.set()

    load = asyncio.ensure_future(_load(spec["load"], slots, first_event))
    load_ended: list[float] = []
    load.add_done_callback(lambda _: load_ended.append(time.monotonic()))
    settled = asyncio.ensure_future(established.wait())
    await asyncio.wait([settled, load], return_when=asyncio.FIRST_COMPLETED)
    settled.cancel()

    spacing = spec["interval_ms"] / 1000 / spec["lanes"]
    close_only = bool(spec.get("close_only"))
    start = time.monotonic()

    async def one(j: int) -> tuple[str, float, bool]:
        await asyncio.sleep(max(0.0, start + j * spacing - time.monotonic()))
        return await _supersede(spec["port"], f"{spec['tag']}-{j}", slots, close_only)

    pairs = await asyncio.gather(*(one(j) for j in range(spec["n"])))
    window = [start, time.monotonic()]  # from the first supersede to the last one's end
    load_results = await load
    # The upstream may see a close a moment after the client saw its stream end (the proxy
    # closes the upstream, then writes the frame): ask again until every one is in.
    closes: dict[str, float] = {}
    deadline = time.monotonic() + 5
    while True:
        closes.update(await _fetch_closes(spec["upstream_port"]))
        if all(old in closes for old, _, _ in pairs) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    latencies = [(closes[old] - sent) * 1000 for old, sent, _ in pairs if old in closes]
    end = load_ended[0] if load_ended else float("inf")
    return {
        "supersedes": len(pairs),
        "sent_under_load": sum(sent < end for _, sent, _ in pairs),
        "fenced": sum(ok for _, _, ok in pairs),
        "closed_seen": len(latencies),
        "fence_ms": latencies,
        "supersede_window": window,
        "load": _summary(load_results, spec["load"]["tokens"] + 2),
    }


async def _fetch_closes(port: int) -> dict[str, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /_bench/closes HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    data = await reader.read()
    writer.close()
    return dict(json.loads(data.split(b"\r\n\r\n", 1)[1]))


KINDS = {"ttft": ttft, "throughput": throughput, "concurrent": concurrent, "fence": fence}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(run_fast(KINDS[spec["kind"]](spec))))
