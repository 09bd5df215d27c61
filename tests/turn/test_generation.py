"""Generation and subscriber, driven directly: a fake upstream stream the test feeds, ASGI
send/receive the test holds. Cheaper and more exact than end-to-end timing for the orders of
events that matter: a supersede landing between the reader's append and the subscriber's
write, a fenced client that never reads, a slow stream with a reading client, a client that
stops reading after an overflow."""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from proxy.errors import ShuttingDown
from proxy.ops.record import Record, Source
from proxy.registry import Lease, MemoryRegistry
from proxy.registry.genlog.meta import End
from proxy.turn import tee as tees
from proxy.turn.ask import Ask
from proxy.turn.buffer import Budget
from proxy.turn.generation import Generation
from proxy.turn.relay import Subscriber
from proxy.turn.rule import Action, Attempt, Policy, decide
from proxy.turn.tee import Tee, TeeFor
from proxy.turn.writes import Exchange
from proxy.upstream.client import UpstreamClient
from proxy.upstream.transport import Transport as FastTransport
from tests.scripted import Script, ScriptedUpstream

Item = bytes | Callable[[], object]


class Feed(httpx.AsyncByteStream):
    """The upstream body: what the test puts in, in order; a callable is run in the reader's
    own step, right after the previous chunk was taken."""

    def __init__(self, endless: bytes | None = None) -> None:
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.closed = asyncio.Event()
        self.pulled = 0
        self.endless = endless
        self.hold_close: asyncio.Event | None = None  # if set: closing waits for it

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            if self.endless is not None:
                await asyncio.sleep(0)  # as a socket read would
                self.pulled += 1
                yield self.endless
                continue
            item = await self.queue.get()
            if callable(item):
                item()
                continue
            if item == b"":
                return
            self.pulled += 1
            yield item

    async def aclose(self) -> None:
        if self.hold_close is not None:
            await self.hold_close.wait()
        self.closed.set()


class Transport(httpx.AsyncBaseTransport):
    def __init__(self, feed: Feed, content_type: str = "text/event-stream") -> None:
        self.feed = feed
        self.content_type = content_type

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        headers = {"content-type": self.content_type}
        return httpx.Response(200, headers=headers, stream=self.feed)


class Client:
    """An ASGI client: records what it is sent; `block_after` writes, it stops reading
    (`stuck` is set) until it reads again, if ever; it leaves (disconnects) when told to.

    A blocked write is recorded only once it returns, as under uvicorn, whose `send` waits
    for the transport to drain before it writes: a write cancelled while blocked was never
    made."""

    def __init__(self, block_after: int | None = None) -> None:
        self.bodies: list[bytes] = []
        self.wrote = asyncio.Event()
        self.block_after = block_after
        self.stuck = asyncio.Event()  # a write is blocked
        self.reading = asyncio.Event()  # it reads again: blocked writes go through
        self.gone = asyncio.Event()

    def read_again(self) -> None:
        self.reading.set()

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body":
            return
        if self.block_after is not None and len(self.bodies) >= self.block_after:
            self.stuck.set()
            await self.reading.wait()
        self.bodies.append(message.get("body", b""))
        self.wrote.set()

    async def wait_bodies(self, n: int) -> None:
        async def written() -> None:
            while len(self.bodies) < n:
                self.wrote.clear()
                await self.wrote.wait()

        await asyncio.wait_for(written(), 5)


def _generation(
    feed: Feed | None = None,
    buffer_bytes: int = 1 << 20,
    followable: bool = True,
    *,
    over: httpx.AsyncBaseTransport | None = None,
    url: str = "http://upstream.test",
    registry: MemoryRegistry | None = None,
    tee: TeeFor | None = None,
    on_end: Callable[[Generation], None] = lambda g: None,
) -> Generation:
    """A generation of one streaming chat request, read from `feed` (or `over` a real
    transport, from the upstream at `url`)."""
    ask = Ask(
        request=httpx.Request("POST", url + "/v1/chat/completions", json={"stream": True}),
        upstream="up",
        key="turn",
        body_hash="body",
        streaming=True,
        max_event_bytes=1 << 20,
        buffer_bytes=buffer_bytes,
        stamp_ids=False,
        followable=followable,
    )
    transport = over or Transport(feed or Feed())
    client = UpstreamClient(transport)
    registry = registry or MemoryRegistry()
    return Generation(ask, client, registry, Budget(1 << 30), on_end, tee=tee)


def _subscribe(
    gen: Generation, client: Client, write_timeout: float = 0.0
) -> tuple[Subscriber, asyncio.Task[None], list[Record]]:
    finished: list[Record] = []
    exchange = Exchange("openai-chat", "turn", Source.UPSTREAM, True, 0, [], write_timeout)
    sub = Subscriber(
        gen, exchange, Record("POST", "/v1/chat/completions"), lambda r, e: finished.append(r)
    )
    task = asyncio.create_task(sub({}, client.receive, client.send))
    return sub, task, finished


async def _one_event_written(
    feed: Feed,
) -> tuple[Generation, Client, asyncio.Task[None], list[Record]]:
    """A generation with one client, which has been written its first event."""
    gen = _generation(feed)
    client = Client()
    _, task, finished = _subscribe(gen, client)
    feed.queue.put_nowait(b"data: one\n\n")
    await client.wait_bodies(1)
    return gen, client, task, finished


def _supersede(gen: Generation) -> Callable[[], None]:
    def now() -> None:
        lease = gen.lease
        assert isinstance(lease, Lease)
        lease.supersede(newer_attempt=2)

    return now


async def test_an_event_taken_just_before_the_fence_is_never_written() -> None:
    feed = Feed()
    gen = _generation(feed)
    first, second = Client(), Client()
    _, task_a, finished = _subscribe(gen, first)
    _, task_b, _ = _subscribe(gen, second)
    feed.queue.put_nowait(b"data: one\n\n")
    await first.wait_bodies(1)
    await second.wait_bodies(1)
    # The reader appends "two" (waking both subscribers) and, in the same step, the newer
    # claim fences the generation: the subscribers' next step comes after the fence. (The
    # fence's cancellation reaches a task whose awaited future is already done, at its next
    # step; the reader writing inline is guarded by the check in the next test.)
    feed.queue.put_nowait(b"data: two\n\n")
    feed.queue.put_nowait(_supersede(gen))
    await asyncio.wait_for(asyncio.gather(task_a, task_b), 5)
    for client in (first, second):
        written = b"".join(client.bodies)
        assert b"data: one" in written and b"data: two" not in written
        assert b"stream_superseded" in written
    assert finished[0].outcome == "superseded"


async def test_the_reader_writing_for_its_one_client_checks_the_fence_too() -> None:
    feed = Feed()
    gen, client, task, finished = await _one_event_written(feed)
    # The fence lands in the reader's own step, before it takes "two" (already queued):
    # the reader writes for its parked client, and must drop it.
    feed.queue.put_nowait(_supersede(gen))
    feed.queue.put_nowait(b"data: two\n\n")
    await asyncio.wait_for(task, 5)
    written = b"".join(client.bodies)
    assert b"data: two" not in written and b"stream_superseded" in written
    assert finished[0].outcome == "superseded"
    assert finished[0].dropped == 1  # streamfence_events_dropped_total: kept back by the fence


async def test_a_fence_closes_the_old_upstream_connection_in_the_claims_own_step(
    upstream: ScriptedUpstream,
) -> None:
    # Over the real transport and a real upstream server: the connection is closed by the
    # newer claim itself, not when the cancelled reader next runs (a loop iteration or more
    # later, on a busy proxy milliseconds).
    upstream.default = Script(tokens=5, gated=True)
    transport = FastTransport()
    gen = _generation(over=transport, url=upstream.url)
    client = Client()
    _, task, finished = _subscribe(gen, client)
    await client.wait_bodies(1)
    assert transport.in_use() == 1
    _supersede(gen)()
    in_the_step = time.perf_counter()
    assert transport.in_use() == 0  # no await since the claim
    await asyncio.wait_for(task, 5)
    await asyncio.wait_for(upstream.seen[0].closed.wait(), 5)
    assert b"stream_superseded" in b"".join(client.bodies)
    assert finished[0].outcome == "superseded"
    # ... and so the record's fence latency says: measured in that step, too.
    latency, lease = finished[0].fence_latency, gen.lease
    assert lease is not None and lease.superseded_at is not None and latency is not None
    assert latency <= in_the_step - lease.superseded_at
    await transport.aclose()


async def test_a_newer_generation_fences_the_older_one_as_it_is_created() -> None:
    # The memory registry claims in the newer request's own step: the older generation is
    # fenced before the newer one's reader task first runs (a loop iteration later: tens of
    # ms under bench B5's load).
    registry = MemoryRegistry()
    feed = Feed()
    old = _generation(feed, registry=registry)
    client = Client()
    _, task, finished = _subscribe(old, client)
    feed.queue.put_nowait(b"data: one\n\n")
    await client.wait_bodies(1)
    newer_feed = Feed()
    newer = _generation(newer_feed, registry=registry)
    assert old.fenced  # no await since the newer generation was made
    await asyncio.wait_for(task, 5)
    await asyncio.wait_for(feed.closed.wait(), 5)
    assert b"stream_superseded" in b"".join(client.bodies)
    assert finished[0].outcome == "superseded"
    newer_feed.queue.put_nowait(b"")
    await asyncio.wait_for(newer.finished.wait(), 5)
    assert newer.lease is not None and not newer.fenced


async def test_a_cancellation_from_outside_still_ends_the_response() -> None:
    # The relay cancels its own task for a fence or a departed client and absorbs only
    # those cancellations: one from elsewhere (a server shutting down) ends it, and the
    # last client leaving still closes the upstream.
    feed = Feed()
    gen, client, task, finished = await _one_event_written(feed)
    task.cancel()
    # Not `with pytest.raises(CancelledError): await task`: that would also swallow a
    # cancellation of this test itself, and the suite's bound with it (tests/bounds.py).
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled()
    await asyncio.wait_for(feed.closed.wait(), 1)
    assert finished[0].outcome == "client_gone"


async def test_a_cancellation_from_outside_is_not_absorbed_with_the_fences_own() -> None:
    feed = Feed()
    gen, client, task, finished = await _one_event_written(feed)
    _supersede(gen)()  # the fence cancels the response's task ...
    task.cancel()  # ... and so does someone else, before it runs again
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled()
    assert b"stream_superseded" not in b"".join(client.bodies)
    assert finished[0].outcome == "superseded"


async def test_a_fenced_reader_closing_its_upstream_is_not_cancelled_again() -> None:
    # The fence cancels the reader; its client (waiting for the upstream's close before its
    # frame) leaves while that close is still under way: the last client leaving must not
    # cancel the reader again, which would cut the close and the reader's end short, and
    # leave the client's response waiting for that end.
    feed = Feed()
    feed.hold_close = asyncio.Event()
    gen, client, task, finished = await _one_event_written(feed)
    _supersede(gen)()
    client.leave()
    for _ in range(100):
        await asyncio.sleep(0)  # it leaves; the reader still closes
    assert not feed.closed.is_set() and not task.done()
    feed.hold_close.set()
    await asyncio.wait_for(task, 5)
    assert feed.closed.is_set() and gen.finished.is_set()
    assert finished[0].outcome == "superseded"


async def test_a_fenced_client_that_does_not_read_does_not_hold_the_upstream() -> None:
    feed = Feed()
    gen = _generation(feed)
    client = Client(block_after=1)  # takes one event, then never reads again
    _sub, task, _ = _subscribe(gen, client, write_timeout=30.0)
    feed.queue.put_nowait(b"data: one\n\n")
    await client.wait_bodies(1)
    feed.queue.put_nowait(_supersede(gen))
    await asyncio.wait_for(feed.closed.wait(), 1)  # long before the write timeout
    assert not task.done()  # its client still owes the frame write
    task.cancel()


async def test_a_fenced_client_that_leaves_while_its_frame_is_written_was_superseded() -> None:
    # The first cause of an ending is the one recorded: the fence came first, the client's
    # leaving (its frame's write still blocked) after; it is counted as superseded.
    feed = Feed()
    gen = _generation(feed)
    client = Client(block_after=1)  # takes one event; the frame's write then blocks
    _, task, finished = _subscribe(gen, client)
    feed.queue.put_nowait(b"data: one\n\n")
    await client.wait_bodies(1)
    feed.queue.put_nowait(_supersede(gen))
    await asyncio.wait_for(client.stuck.wait(), 5)  # the upstream closed, the frame under way
    assert feed.closed.is_set()
    client.leave()
    await asyncio.wait_for(task, 5)
    assert finished[0].outcome == "superseded"


async def test_a_write_blocked_when_the_fence_lands_is_never_made() -> None:
    # A client that is not reading holds its write of events taken before the fence: the
    # fence interrupts that write (under uvicorn, a blocked send has not written yet), so
    # that nothing but the frame reaches the client after the newer attempt was accepted,
    # even when it reads again.
    feed = Feed()
    gen = _generation(feed)
    first = Client()
    _, task_a, _ = _subscribe(gen, first)
    for n, event in enumerate((b"data: one\n\n", b"data: two\n\n")):
        feed.queue.put_nowait(event)
        await first.wait_bodies(n + 1)
    late = Client(block_after=0)  # it writes both from the buffer itself, and is not read
    _, task_b, finished = _subscribe(gen, late)
    await asyncio.wait_for(late.stuck.wait(), 5)
    _supersede(gen)()
    await asyncio.wait_for(feed.closed.wait(), 5)
    late.read_again()
    await asyncio.wait_for(asyncio.gather(task_a, task_b), 5)
    written = b"".join(late.bodies)
    assert b"data: one" not in written and b"data: two" not in written
    assert b"stream_superseded" in written
    assert finished[0].outcome == "superseded"


async def test_a_shutdown_does_not_break_off_the_frame_of_a_fenced_client() -> None:
    # The fence's frame is being written (its client not reading yet) when the shutdown ends
    # every request: past the serving of events, nothing interrupts the frame; the client
    # gets it, and a clean end, once it reads.
    feed = Feed()
    gen = _generation(feed)
    client = _Ending(block_after=1)
    sub, task, finished = _subscribe(gen, client)
    feed.queue.put_nowait(b"data: one\n\n")
    await client.wait_bodies(1)
    feed.queue.put_nowait(_supersede(gen))
    await asyncio.wait_for(client.stuck.wait(), 5)
    sub.abort(ShuttingDown("streamfence: shutting down"))
    client.read_again()
    await asyncio.wait({task}, timeout=5)
    assert task.done() and not task.cancelled()
    assert b"stream_superseded" in client.bodies[1] and client.ends[-1]
    assert finished[0].outcome == "superseded"


async def test_a_stream_ended_by_the_shutdown_ends_cleanly_after_its_error_event() -> None:
    # The proxy's own ending is not a cut (CONTRACT section 5): the dialect's error event,
    # then the end of the body, as for the fence's frame. ("two" is written by the reader,
    # for its client caught up and waiting: that write is over, nothing to wait for.)
    feed = Feed()
    gen = _generation(feed)
    client = _Ending()
    sub, task, finished = _subscribe(gen, client)
    for n, event in enumerate((b"data: one\n\n", b"data: two\n\n")):
        feed.queue.put_nowait(event)
        await client.wait_bodies(n + 1)
    sub.abort(ShuttingDown("streamfence: shutting down"))
    await asyncio.wait_for(task, 5)
    assert b"shutting_down" in client.bodies[2]
    assert client.ends == [False, False, False, True]
    assert finished[0].outcome == "shutdown"
    await asyncio.wait_for(feed.closed.wait(), 5)


async def test_a_shutdown_leaves_a_json_body_under_way_to_finish() -> None:
    # Not an event stream: it has no place for an error event, and its headers are out: the
    # body goes on whole (CONTRACT section 2), never cut short with a clean end.
    feed = Feed()
    gen = _generation(over=Transport(feed, "application/json"))
    client = _Ending()
    sub, task, finished = _subscribe(gen, client)
    feed.queue.put_nowait(b'{"id": "x", ')
    await client.wait_bodies(1)
    sub.abort(ShuttingDown("streamfence: shutting down"))
    feed.queue.put_nowait(b'"choices": []}')
    feed.queue.put_nowait(b"")
    await asyncio.wait_for(task, 5)
    assert json.loads(b"".join(client.bodies)) == {"id": "x", "choices": []}
    assert client.ends[-1] and finished[0].outcome == "completed"


async def test_a_client_ended_by_the_shutdown_gets_nothing_after_its_error_event() -> None:
    # Its error event's write is blocked when the upstream sends on: the reader, which
    # writes for a caught-up client that waits in the generation, must not take this one
    # for it (two writers at once, and events after the error event).
    feed = Feed()
    gen = _generation(feed)
    client = Client(block_after=1)
    sub, task, finished = _subscribe(gen, client)
    feed.queue.put_nowait(b"data: one\n\n")
    await client.wait_bodies(1)
    sub.abort(ShuttingDown("streamfence: shutting down"))
    await asyncio.wait_for(client.stuck.wait(), 5)  # its error event's write
    taken = asyncio.Event()
    feed.queue.put_nowait(b"data: two\n\n")
    feed.queue.put_nowait(taken.set)  # run by the reader once "two" is taken
    await asyncio.wait_for(taken.wait(), 5)
    client.read_again()
    await asyncio.wait_for(task, 5)
    assert client.bodies[0] == b"data: one\n\n" and b"shutting_down" in client.bodies[1]
    assert b"data: two" not in b"".join(client.bodies)
    assert finished[0].outcome == "shutdown"


async def test_a_server_cancelling_as_the_fenced_client_leaves_is_not_absorbed() -> None:
    # The fence's cancellation was absorbed; then, while the frame's write is blocked, the
    # client leaves and the server cancels the response at once: the relay absorbs its own
    # second cancellation only, and the server's ends the response.
    feed = Feed()
    gen = _generation(feed)
    client = Client(block_after=1)
    task: asyncio.Task[None] | None = None

    async def receive() -> dict[str, Any]:
        await client.gone.wait()
        assert task is not None
        task.cancel()  # the server, in the step the client's leaving is seen
        return {"type": "http.disconnect"}

    finished: list[Record] = []
    exchange = Exchange("openai-chat", "turn", Source.UPSTREAM, True, 0, [], 0.0)
    sub = Subscriber(
        gen, exchange, Record("POST", "/v1/chat/completions"), lambda r, e: finished.append(r)
    )
    task = asyncio.create_task(sub({}, receive, client.send))
    feed.queue.put_nowait(b"data: one\n\n")
    await client.wait_bodies(1)
    feed.queue.put_nowait(_supersede(gen))
    await asyncio.wait_for(client.stuck.wait(), 5)  # the fence absorbed, its frame blocked
    client.leave()
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled()
    assert finished[0].outcome == "superseded"


async def test_a_fence_before_a_clients_response_began_gets_it_the_409() -> None:
    feed = Feed()
    gen, first, task_a, _ = await _one_event_written(feed)
    client = Client()
    _, task_b, finished = _subscribe(gen, client)  # attached; its response not begun yet
    _supersede(gen)()
    await asyncio.wait_for(asyncio.gather(task_a, task_b), 5)
    (body,) = client.bodies  # headers not sent: a whole error response
    assert json.loads(body)["error"]["code"] == "stream_superseded"
    assert (finished[0].outcome, finished[0].status) == ("superseded", 409)


async def test_a_finished_response_leaves_nothing_that_holds_its_subscriber() -> None:
    # Its disconnect watch (the server may never answer `receive`) and its write timeout's
    # timer end with it: neither keeps the subscriber, its generation and its buffer alive.
    before = asyncio.all_tasks()
    feed = Feed()
    gen = _generation(feed)
    client = Client()
    sub, task, finished = _subscribe(gen, client, write_timeout=30.0)
    for item in (b"data: one\n\n", b"data: [DONE]\n\n", b""):
        feed.queue.put_nowait(item)
    await asyncio.wait_for(task, 5)
    await asyncio.wait_for(gen.finished.wait(), 5)
    assert finished[0].outcome == "completed"
    assert asyncio.all_tasks() <= before
    held = weakref.ref(sub)
    del sub, task
    assert held() is None


async def test_a_slow_stream_with_a_reading_client_is_not_dropped_by_the_write_timeout() -> None:
    feed = Feed()
    gen = _generation(feed)
    client = Client()
    _sub, task, finished = _subscribe(gen, client, write_timeout=0.1)
    for n in range(4):
        feed.queue.put_nowait(b"data: %d\n\n" % n)
        await client.wait_bodies(n + 1)
        await asyncio.sleep(0.15)  # the scenario: an upstream slower than the write timeout
    feed.queue.put_nowait(b"data: [DONE]\n\n")
    feed.queue.put_nowait(b"")
    await asyncio.wait_for(task, 5)
    assert finished[0].outcome == "completed" and finished[0].events == 5


BIG = b"data: " + b"x" * 50 + b"\n\n"  # the fifth goes past a 200-byte cap
ANSWER = BIG * 20 + b"data: [DONE]\n\n"


@dataclass
class HeldBack:
    gen: Generation
    feed: Feed
    slow: Client
    fast: Client
    slow_task: asyncio.Task[None]
    fast_task: asyncio.Task[None]
    fast_records: list[Record]


async def _held_back(tee: TeeFor | None = None) -> HeldBack:
    """A generation over its 200-byte cap (no longer followable) whose whole ANSWER is in its
    feed, with a client that stopped reading after one event and a fast one: its reader is
    held back by the slow one, the fast one has not got it all."""
    feed = Feed()
    gen = _generation(feed, buffer_bytes=200, tee=tee)
    slow, fast = Client(block_after=1), Client()
    _, slow_task, _ = _subscribe(gen, slow)
    _, fast_task, fast_records = _subscribe(gen, fast)
    for chunk in [BIG] * 20 + [b"data: [DONE]\n\n", b""]:
        feed.queue.put_nowait(chunk)
    await asyncio.wait_for(slow.stuck.wait(), 5)
    for _ in range(500):
        await asyncio.sleep(0)  # the reader and the fast client run as far as they may
    assert not gen.followable and feed.pulled < 21 and len(fast.bodies) < 21
    return HeldBack(gen, feed, slow, fast, slow_task, fast_task, fast_records)


async def test_after_an_overflow_the_reader_waits_for_its_slowest_client() -> None:
    feed = Feed(endless=BIG)
    gen = _generation(feed, buffer_bytes=200)
    slow, fast = Client(block_after=1), Client()
    _, slow_task, _ = _subscribe(gen, slow)
    _, fast_task, _ = _subscribe(gen, fast)
    await slow.wait_bodies(1)
    for _ in range(500):
        await asyncio.sleep(0)  # let the reader and the fast client run as far as they may
    assert not gen.followable  # over its cap: nobody may follow it any more
    assert feed.pulled < 12  # held back by the client that stopped reading
    assert gen.buffer.size <= 200 + len(BIG)
    for task in (slow_task, fast_task):
        task.cancel()
    await asyncio.gather(slow_task, fast_task, return_exceptions=True)
    assert feed.closed.is_set()


async def test_when_the_slow_client_leaves_a_held_back_reader_the_fast_one_gets_the_rest() -> None:
    # Over its cap, the buffer keeps what its slowest client has yet to write, and the reader
    # waits for room. That client leaving makes the room: the one left, caught up and
    # waiting, gets the rest of the answer (nothing else would ever wake the reader).
    held = await _held_back()
    held.slow.leave()
    await asyncio.wait_for(held.fast_task, 5)
    assert b"".join(held.fast.bodies) == ANSWER
    assert held.fast_records[0].outcome == "completed"
    await asyncio.wait_for(held.slow_task, 5)


async def test_a_held_back_reader_goes_on_as_its_slow_client_reads_again() -> None:
    # Over its cap, the reader waits for room; the slow client writing again makes it (each
    # write drops what every client has written), and both get the whole answer.
    held = await _held_back()
    held.slow.read_again()
    await asyncio.wait_for(asyncio.gather(held.slow_task, held.fast_task), 5)
    for client in (held.slow, held.fast):
        assert b"".join(client.bodies) == ANSWER


async def test_a_client_that_stops_reading_holds_back_the_reader_writing_for_it() -> None:
    feed = Feed(endless=BIG)
    gen = _generation(feed, buffer_bytes=200)
    client = Client(block_after=1)
    _, task, _ = _subscribe(gen, client)
    await client.wait_bodies(1)
    for _ in range(500):
        await asyncio.sleep(0)
    assert feed.pulled < 5 and gen.buffer.size <= 200 + len(BIG)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert feed.closed.is_set()


async def test_a_generation_whose_last_client_left_is_not_followed_while_it_closes() -> None:
    # Its upstream is being closed (slowly, here): an identical request arriving now would
    # follow an answer that is about to be cut; the rule must send it upstream instead.
    feed = Feed()
    feed.hold_close = asyncio.Event()
    gen, client, task, _ = await _one_event_written(feed)
    identical = Attempt("body", True, True, None)
    policy = Policy("adaptive", 3600.0, False)
    assert decide(gen, identical, policy, time.monotonic()).action is Action.FOLLOW
    client.leave()
    for _ in range(100):
        await asyncio.sleep(0)  # the client's task detaches; the upstream starts to close
    assert not task.done() and not feed.closed.is_set()
    assert decide(gen, identical, policy, time.monotonic()).action is Action.NEW
    feed.hold_close.set()
    await asyncio.wait_for(task, 5)


async def test_a_generation_ends_once_however_many_ask_it_to() -> None:
    # Its replay window ending and a newer version fencing it may each ask, in one loop
    # iteration: the table must be told once (the ledger would count the answer twice).
    feed = Feed()
    ended: list[Generation] = []
    gen = _generation(feed, on_end=ended.append)
    feed.queue.put_nowait(b"data: one\n\n")
    feed.queue.put_nowait(b"")
    await asyncio.wait_for(gen.finished.wait(), 5)
    await asyncio.gather(gen.end(), gen.end())
    assert ended == [gen] and gen.buffer.size == 0


async def test_the_last_client_leaving_closes_the_upstream_and_releases_the_lease() -> None:
    feed = Feed()
    gen = _generation(feed)
    registry = gen._registry
    assert isinstance(registry, MemoryRegistry)
    first, second = Client(), Client()
    _, task_a, _ = _subscribe(gen, first)
    _, task_b, _ = _subscribe(gen, second)
    feed.queue.put_nowait(b"data: one\n\n")
    await first.wait_bodies(1)
    await second.wait_bodies(1)
    task_a.cancel()
    await asyncio.gather(task_a, return_exceptions=True)
    assert not feed.closed.is_set() and registry.live_keys() == 1
    task_b.cancel()
    await asyncio.gather(task_b, return_exceptions=True)
    assert feed.closed.is_set() and registry.live_keys() == 0


class _Ending(Client):
    """A client that records whether each body message ended the response."""

    def __init__(self, block_after: int | None = None) -> None:
        super().__init__(block_after)
        self.ends: list[bool] = []

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            self.ends.append(not message.get("more_body", False))
        await super().send(message)


async def test_a_client_that_finds_the_whole_answer_in_ends_with_it_in_one_write() -> None:
    # The answer and its end are all in before the client writes anything: it writes them
    # and the end of the response as one message (one write), not an empty one after.
    feed = Feed()
    gen = _generation(feed)
    holder = Client(block_after=0)  # keeps the generation, and its buffer, while it runs
    _, holding, _ = _subscribe(gen, holder)
    for chunk in (b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n", b""):
        feed.queue.put_nowait(chunk)
    await asyncio.wait_for(gen.finished.wait(), 5)
    client = _Ending()
    _, task, finished = _subscribe(gen, client)  # a follower of the finished generation
    await asyncio.wait_for(task, 5)
    assert client.bodies == [b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"]
    assert client.ends == [True]
    assert finished[0].outcome == "completed"
    holding.cancel()
    await asyncio.gather(holding, return_exceptions=True)


@pytest.mark.parametrize(
    ("last", "bodies", "ends"),
    [
        (b"data: [DONE]\n\n", [b"data: one\n\n", b"data: [DONE]\n\n"], [False, True]),
        # An unterminated last event, one byte long: it is completed at the end and still
        # written, so the response cannot end with the event before it.
        (
            b"data: [DONE]\n\n:",
            [b"data: one\n\n", b"data: [DONE]\n\n", b":\n\n", b""],
            [False, False, False, True],
        ),
    ],
    ids=["whole", "unterminated-tail"],
)
async def test_the_reader_ends_its_clients_response_with_the_last_read(
    last: bytes, bodies: list[bytes], ends: list[bool]
) -> None:
    # Over the real transport: the upstream's last write holds the last event and the end of
    # its chunked body, so the reader, writing for its caught-up client, ends the response.
    last_part = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(len(b'{"stream":true}'))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + _chunked(b"data: one\n\n")
        )
        await last_part.wait()
        writer.write(_chunked(last) + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = FastTransport()
    try:
        gen = _generation(over=transport, url=f"http://127.0.0.1:{port}")
        client = _Ending()
        _, task, finished = _subscribe(gen, client)
        await client.wait_bodies(1)
        last_part.set()
        await asyncio.wait_for(task, 5)
    finally:
        server.close()
        await transport.aclose()
    assert client.bodies == bodies
    assert client.ends == ends
    assert finished[0].outcome == "completed"


async def test_a_shutdown_while_the_reader_writes_the_last_events_leaves_the_answer_whole() -> None:
    # The reader writes the stream's last events for its caught-up client, the end of the
    # response with them, and the client does not read yet: the shutdown that lands then
    # waits for that write (one writer at a time), which delivers the whole answer; no
    # error event may follow the end of the response (uvicorn refuses a write after it).
    last_part = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(len(b'{"stream":true}'))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + _chunked(b"data: one\n\n")
        )
        await last_part.wait()
        writer.write(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = FastTransport()
    try:
        gen = _generation(over=transport, url=f"http://127.0.0.1:{port}")
        client = _Ending(block_after=1)
        sub, task, finished = _subscribe(gen, client)
        await client.wait_bodies(1)
        last_part.set()
        await asyncio.wait_for(client.stuck.wait(), 5)  # the reader's write, ending it
        sub.abort(ShuttingDown("streamfence: shutting down"))
        client.read_again()
        await asyncio.wait_for(task, 5)
    finally:
        server.close()
        await transport.aclose()
    assert client.bodies == [b"data: one\n\n", b"data: [DONE]\n\n"]
    assert client.ends == [False, True]
    assert finished[0].outcome == "completed"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class RecordingTee:
    """A stand-in for the generation log's writer: records what its generation tells it, and
    answers `readers_elsewhere` with the counts the test puts in `readers`, when it does."""

    def __init__(self) -> None:
        self.broken = False
        self.told: list[tuple[str, object]] = []
        self.readers: asyncio.Queue[int] = asyncio.Queue()
        self.asked = 0
        self.asking = asyncio.Event()  # set whenever the generation asks
        self.reopened = 0
        self.ended = asyncio.Event()
        self.reopening = asyncio.Event()

    def started(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        self.told.append(("started", status))

    def append(self, events: Sequence[bytes], content: bool = True) -> None:
        self.told.extend(("event", e) for e in events)

    async def end(self, outcome: End) -> None:
        self.told.append(("end", outcome))
        self.ended.set()

    async def readers_elsewhere(self) -> int:
        self.asked += 1
        self.asking.set()
        return await self.readers.get()

    def reopen(self) -> None:
        self.reopened += 1
        self.reopening.set()

    def maker(self) -> tuple[TeeFor, list[int]]:
        """What the table would give the generation, and the tokens it was made for."""
        tokens: list[int] = []

        def tee_for(token: int) -> Tee:
            tokens.append(token)
            return self

        return tee_for, tokens

    async def asked_at_least(self, n: int) -> None:
        while self.asked < n:
            self.asking.clear()
            await asyncio.wait_for(self.asking.wait(), 5)


async def test_a_published_generation_tells_its_tee_its_start_its_events_and_its_end() -> None:
    tee = RecordingTee()
    tee_for, tokens = tee.maker()
    feed = Feed()
    gen = _generation(feed, tee=tee_for)
    client = Client()
    _, task, _ = _subscribe(gen, client)
    for item in (b"data: one\n\n", b"data: two\n\n", b""):
        feed.queue.put_nowait(item)
    await asyncio.wait_for(task, 5)
    await asyncio.wait_for(tee.ended.wait(), 5)  # told in a task of its own
    assert tokens == [gen.token]  # made once, for the token its turn was claimed with
    assert tee.told == [
        ("started", 200),
        ("event", b"data: one\n\n"),
        ("event", b"data: two\n\n"),
        ("end", End.COMPLETED),
    ]


async def test_with_no_client_here_the_upstream_stays_open_while_its_tee_has_readers_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tees, "RECHECK", 0.01)  # the writer's recount: every second
    tee = RecordingTee()
    feed = Feed()
    gen, client, task, _ = await _one_event_written_to(feed, tee)
    tee.readers.put_nowait(1)
    client.leave()
    await asyncio.wait_for(task, 5)
    await tee.asked_at_least(2)  # asked again after the answer "one reader elsewhere"
    assert not feed.closed.is_set() and not gen.done
    tee.readers.put_nowait(0)  # the last reader elsewhere left
    await asyncio.wait_for(feed.closed.wait(), 5)
    await asyncio.wait_for(gen.finished.wait(), 5)
    assert tee.reopened == 0


async def test_a_client_here_again_keeps_the_upstream_and_reopens_what_its_tee_closed() -> None:
    tee = RecordingTee()
    feed = Feed()
    gen, first, task, _ = await _one_event_written_to(feed, tee)
    first.leave()
    await asyncio.wait_for(task, 5)
    await tee.asked_at_least(1)
    again = Client()
    _, task, finished = _subscribe(gen, again)  # attaches while the tee is being asked
    await again.wait_bodies(1)
    tee.readers.put_nowait(0)  # none elsewhere: the tee closed itself to new readers
    await asyncio.wait_for(tee.reopening.wait(), 5)
    assert not feed.closed.is_set()  # the client here reads on
    feed.queue.put_nowait(b"data: two\n\n")
    feed.queue.put_nowait(b"")
    await asyncio.wait_for(task, 5)
    assert b"data: two" in b"".join(again.bodies) and finished[0].outcome == "completed"


async def test_the_last_client_here_leaving_a_held_back_reader_frees_it_for_readers_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Over its cap (so no longer followable), the reader waits for the slow one of its two
    # clients here; both leave while another process reads the generation through its tee:
    # the reader must go on to the end for it, not wait for room nobody will make.
    monkeypatch.setattr(tees, "RECHECK", 0.01)
    tee = RecordingTee()
    held = await _held_back(tee.maker()[0])
    for _ in range(50):
        tee.readers.put_nowait(1)  # one reader elsewhere, whenever asked
    held.fast.leave()
    await asyncio.wait_for(held.fast_task, 5)
    held.slow.leave()
    await asyncio.wait_for(held.slow_task, 5)
    await asyncio.wait_for(held.gen.finished.wait(), 5)
    assert held.gen.completed and held.feed.pulled == 21
    assert [e for kind, e in tee.told if kind == "event"][-1] == b"data: [DONE]\n\n"


async def test_a_broken_tee_does_not_hold_the_upstream_for_readers_elsewhere() -> None:
    tee = RecordingTee()
    tee.broken = True  # it stopped publishing: nobody elsewhere reads it any more
    feed = Feed()
    _, client, task, _ = await _one_event_written_to(feed, tee)
    client.leave()
    await asyncio.wait_for(task, 5)
    assert feed.closed.is_set()  # closed by the leaving client itself, not in the background
    assert tee.asked == 0


async def _one_event_written_to(
    feed: Feed, tee: RecordingTee
) -> tuple[Generation, Client, asyncio.Task[None], list[Record]]:
    """A published generation with one client, which has been written its first event."""
    gen = _generation(feed, tee=tee.maker()[0])
    client = Client()
    _, task, finished = _subscribe(gen, client)
    feed.queue.put_nowait(b"data: one\n\n")
    await client.wait_bodies(1)
    return gen, client, task, finished
