"""Issue 27 across two processes on Redis (single and cluster): a stream stalled behind
keep-alives is stalled for the other process too (the log's `last` stamp moves on content
only), and a stream the upstream cut is cut for followers in the other process as well."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import httpx
import pytest

from tests.conftest import ProxyFactory
from tests.redis_server import REDIS_SERVER, RedisServer, Server
from tests.scripted import ScriptedUpstream
from tests.sse_client import Event, chat_body, events, open_stream
from tests.turn.test_remote_follow import CHAT, _errors, _origin_then_follower, _rest, two_proxies

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")

OPENROUTER = ": OPENROUTER PROCESSING\n\n"


async def _cut_after_error(stream: AsyncIterator[Event]) -> list[Event]:
    """The rest of a stream that must end with an error event and then a cut body."""
    got: list[Event] = []
    with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
        async for event in stream:
            got.append(event)
    return got


async def test_a_stream_stalled_behind_keepalives_in_one_process_is_replaced_from_another(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream, redis_server: Server
) -> None:
    """Process A's generation sends a token, then only OpenRouter's comments. The same
    request on process B, past healthy_within and right after a comment, starts a new
    generation (attempt 2) instead of following the stuck one: A's client is told it was
    superseded, its upstream closed; B's answer is its own, whole."""
    body = chat_body(gated=True, tokens=3, prefix="K", keepalive=OPENROUTER)
    turn = {"X-Turn-Id": "remote-stall"}
    window = {"upstream.healthy_within": 0.5}
    async with two_proxies(make_proxy, upstream, redis_server, **window) as (pa, pb):
        async with pa.client() as ca, pb.client() as cb, AsyncExitStack() as stack:
            a = await open_stream(stack, ca, CHAT, body, turn)
            a_events = events(a)
            assert (await anext(a_events)).text == "K0 "
            (stuck,) = upstream.seen
            await asyncio.sleep(0.7)
            stuck.pinged.clear()
            await asyncio.wait_for(stuck.pinged.wait(), 5)  # a keep-alive, just now
            b = await open_stream(stack, cb, CHAT, body, turn)
            assert b.headers["x-streamfence-source"] == "upstream"
            assert b.headers["x-streamfence-attempt"] == "2"
            a_rest = await asyncio.wait_for(_rest(a_events), 10)
            assert _errors(a_rest) == ["stream_superseded"]
            await asyncio.wait_for(stuck.closed.wait(), 5)
            upstream.seen[1].release(10)
            b_rest = await asyncio.wait_for(_rest(events(b)), 10)
        assert "".join(e.text for e in b_rest) == "K0 K1 K2 "
        assert b_rest[-1].data == "[DONE]"
        assert len(upstream.seen) == 2


async def test_a_retry_beside_a_follower_of_a_remote_stalled_generation_replaces_it(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream, redis_server: Server
) -> None:
    """Process B follows A's generation while it is healthy; it then stalls behind
    keep-alives. A retry on B is judged by B's local table, against B's follower of the
    remote generation: stalled by the writer's stamp (not by when B last read a batch of
    keep-alives), so it starts attempt 2 and both earlier clients are told they were
    superseded."""
    body = chat_body(gated=True, tokens=3, prefix="L", keepalive=OPENROUTER)
    turn = {"X-Turn-Id": "remote-local-stall"}
    window = {"upstream.healthy_within": 0.5}
    async with two_proxies(make_proxy, upstream, redis_server, **window) as (pa, pb):
        async with pa.client() as ca, pb.client() as cb, AsyncExitStack() as stack:
            _, a_events, b, b_events = await _origin_then_follower(
                stack, ca, cb, body, turn, first="L0 "
            )
            assert b.headers["x-streamfence-source"] == "followed"
            (stuck,) = upstream.seen
            await asyncio.sleep(0.7)
            stuck.pinged.clear()
            await asyncio.wait_for(stuck.pinged.wait(), 5)
            retry = await open_stream(stack, cb, CHAT, body, turn)
            assert retry.headers["x-streamfence-source"] == "upstream"
            assert retry.headers["x-streamfence-attempt"] == "2"
            rests = await asyncio.wait_for(asyncio.gather(_rest(a_events), _rest(b_events)), 10)
            assert [_errors(r) for r in rests] == [["stream_superseded"]] * 2
            upstream.seen[1].release(10)
            got = await asyncio.wait_for(_rest(events(retry)), 10)
        assert "".join(e.text for e in got) == "L0 L1 L2 "
        assert len(upstream.seen) == 2


async def test_keepalives_between_tokens_keep_a_remote_generation_followable(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream, single_redis: RedisServer
) -> None:
    """No false stall across processes: tokens every 0.3 s (a comment between two) under a
    1 s window; the same request on process B 1.3 s later follows it."""
    body = chat_body(tokens=8, delay=0.3, prefix="F", keepalive=OPENROUTER)
    turn = {"X-Turn-Id": "remote-alive"}
    window = {"upstream.healthy_within": 1.0}
    async with two_proxies(make_proxy, upstream, single_redis, **window) as (pa, pb):
        async with pa.client() as ca, pb.client() as cb, AsyncExitStack() as stack:
            a = await open_stream(stack, ca, CHAT, body, turn)
            a_events = events(a)
            assert (await anext(a_events)).text == "F0 "
            await asyncio.sleep(1.3)
            b = await open_stream(stack, cb, CHAT, body, turn)
            assert b.headers["x-streamfence-source"] == "followed"
            got = await asyncio.wait_for(asyncio.gather(_rest(a_events), _rest(events(b))), 10)
        assert "".join(e.text for e in got[1]) == "".join(f"F{i} " for i in range(8))
        assert len(upstream.seen) == 1


async def test_a_stream_cut_upstream_is_cut_for_a_follower_in_another_process(
    make_proxy: ProxyFactory, upstream: ScriptedUpstream, redis_server: Server
) -> None:
    """The upstream breaks mid-body under process A; A's client and B's follower each get
    the error event, then a body without its terminator, as a direct client would."""
    body = chat_body(gated=True, tokens=5, fail_after=3, prefix="C")
    turn = {"X-Turn-Id": "remote-cut"}
    async with two_proxies(make_proxy, upstream, redis_server) as (pa, pb):
        async with pa.client() as ca, pb.client() as cb, AsyncExitStack() as stack:
            _, a_events, b, b_events = await _origin_then_follower(
                stack, ca, cb, body, turn, first="C0 "
            )
            assert b.headers["x-streamfence-source"] == "followed"
            upstream.seen[0].release(10)
            a_rest, b_rest = await asyncio.wait_for(
                asyncio.gather(_cut_after_error(a_events), _cut_after_error(b_events)), 10
            )
    for rest in (a_rest, b_rest):
        assert "".join(e.text for e in rest) == "C1 C2 "
        assert rest[-1].is_error and _errors(rest) == ["upstream_error"]
        assert not any(e.data == "[DONE]" for e in rest)
