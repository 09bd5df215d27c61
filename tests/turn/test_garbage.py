"""A finished request leaves nothing to the garbage collector: reference counting frees every
object of the proxy's as soon as the request is done, fenced, followed or abandoned.

Why it matters (docs/history/benchmarks-2026-12.md, "the host, and garbage"): cycles through a
generation's lease callback, its cancelled reader's exception, a subscriber's write guard and an
upstream connection's parser made every request's objects cyclic garbage, 78,000 objects per 1,000
requests under bench B5. The collections that freed them took a fifth of the proxy's CPU, and their
pauses (3-8 ms for the middle generation, 16-27 ms for the oldest) were B5's p99.
"""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager

from websockets.asyncio.client import connect

from proxy import tasks
from proxy.errors import UpstreamError, kept
from tests.conftest import Proxy, ProxyFactory
from tests.scripted import ScriptedUpstream, free_port
from tests.sse_client import chat_body, events, events_of_a_cut_body, open_stream
from tests.websocket.test_fence import SUPERSEDE, create, events_until_end, opening, ws_url
from tests.ws_upstream import ws_upstream

CHAT = "/v1/chat/completions"


@contextmanager
def _garbage() -> Iterator[Counter[str]]:
    """The proxy's objects that only the collector could free, by type, once the block ends."""
    found: Counter[str] = Counter()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage
    try:
        yield found
        gc.collect()
        found.update(
            type(o).__qualname__
            for o in gc.garbage
            if type(o).__module__.startswith("proxy")
            # A test's event loop is the test runner's, not a request's (its class is the
            # proxy's own, proxy.server.listen.Loop): an earlier test's loop that something
            # outside the proxy still held can become garbage in this block (CI, twice).
            and not isinstance(o, asyncio.AbstractEventLoop)
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def _settled(proxy: Proxy) -> None:
    """Every request finished and every background step (a lease's release) has run."""
    await asyncio.wait_for(proxy.runtime.wait_idle(), 5)
    for _ in range(1000):
        if not tasks._background:
            return
        await asyncio.sleep(0)
    raise AssertionError("background tasks still running")


async def test_a_whole_stream_and_a_whole_answer(proxy: Proxy) -> None:
    with _garbage() as found:
        async with proxy.client() as client:
            for i in range(3):
                streamed = await client.post(CHAT, json=chat_body(f"s{i}"))
                assert streamed.text.endswith("data: [DONE]\n\n")
                answer = await client.post(CHAT, json={**chat_body(f"a{i}"), "stream": False})
                assert answer.status_code == 200
            await _settled(proxy)
    assert found == Counter()


async def test_a_fenced_stream_and_its_successor(proxy: Proxy, upstream: ScriptedUpstream) -> None:
    with _garbage() as found:
        async with proxy.client() as client:
            for i in range(3):
                turn = {"X-Turn-Id": f"turn-{i}"}
                async with AsyncExitStack() as stack:
                    old = await open_stream(stack, client, CHAT, chat_body(gated=True), turn)
                    old_events = events(old)
                    await anext(old_events)
                    newer = await client.post(CHAT, json=chat_body(), headers=turn)
                    assert newer.status_code == 200
                    rest = [e async for e in old_events]
                    assert "stream_superseded" in rest[-1].data
            await _settled(proxy)
    assert found == Counter()


async def test_a_follower_and_a_client_that_leaves(
    proxy: Proxy, upstream: ScriptedUpstream
) -> None:
    with _garbage() as found:
        async with proxy.client() as client:
            async with AsyncExitStack() as stack:
                first = await open_stream(stack, client, CHAT, chat_body("twin", gated=True))
                await anext(events(first))
                twin = await open_stream(stack, client, CHAT, chat_body("twin", gated=True))
                assert twin.headers["x-streamfence-source"] == "followed"
            # Both clients left mid-stream: the last one closes the upstream.
            await asyncio.wait_for(upstream.seen[0].closed.wait(), 5)
            await _settled(proxy)
    assert found == Counter()


async def test_an_upstream_that_fails_mid_stream_or_cannot_be_reached(
    proxy: Proxy, make_proxy: ProxyFactory
) -> None:
    # (The second app is made outside the block: an app's own objects are its lifespan's.)
    async with make_proxy(f"http://127.0.0.1:{free_port()}") as nowhere:
        with _garbage() as found:
            async with proxy.client() as client:
                for i in range(3):
                    body = chat_body(f"b{i}", tokens=5, fail_after=2)
                    async with client.stream("POST", CHAT, json=body) as r:
                        got = await events_of_a_cut_body(r)
                    assert got[-1].is_error
            async with nowhere.client() as client:
                refused = await client.post(CHAT, json=chat_body())
                assert refused.status_code == 502
            await _settled(nowhere)
            await _settled(proxy)
    assert found == Counter()


def test_a_kept_error_has_no_frames_along_its_chain_and_a_looped_chain_ends() -> None:
    def fail() -> None:
        try:
            raise OSError("refused")
        except OSError as exc:
            raise UpstreamError("streamfence: the upstream is unreachable") from exc

    try:
        fail()
    except UpstreamError as exc:
        error = exc
    assert error.__traceback__ is not None and error.__cause__ is not None
    assert kept(error) is error
    assert error.__traceback__ is None and error.__cause__.__traceback__ is None
    assert str(error.__cause__) == "refused"  # what the log's cause is made of stays
    looped = ValueError("a")
    looped.__cause__ = ValueError("b")
    looped.__cause__.__cause__ = looped
    assert kept(looped) is looped


async def test_websocket_responses_plain_and_fenced(make_proxy: ProxyFactory) -> None:
    # Per response (a ResponseAttempt, its Record and Lease, the socket's fence) nothing is
    # left for the collector. Once per socket its Session is: anyio's task group keeps a cancelled
    # child's CancelledError in its own frame (a cycle through that error's traceback, which
    # holds the child's frames and so the session); sockets are few and long-lived.
    # uvicorn's HTTP protocol (proxy.server.eager's subclass) is one too after the upgrade: its
    # parser holds its callbacks; before the subclass that cycle was uvicorn's, uncounted.
    per_socket = {"Session", "Upgrade", "Route", "Protocol"}
    async with ws_upstream() as wsup, make_proxy(wsup.url, **SUPERSEDE) as proxy:
        with _garbage() as found:
            for i in range(2):
                async with connect(ws_url(proxy)) as ws:
                    for j in range(3):
                        await ws.send(create(f"t{i}{j}", tokens=["a", "b"]))
                        assert (await events_until_end(ws))[-1]["type"] == "response.completed"
                    await ws.send(create("same", gated=True, tokens=3))
                    await opening(ws)
                    async with connect(ws_url(proxy)) as newer:
                        await newer.send(create("same", tokens=["b"]))
                        assert (await events_until_end(newer))[-1]["type"] == "response.completed"
                    fenced = await events_until_end(ws)
                    assert fenced[-1]["code"] == "stream_superseded"
                await _settled(proxy)
        leftover = Counter({k: v for k, v in found.items() if k not in per_socket})
    assert leftover == Counter()
