"""Stress for generations and followers: many concurrent turns, each a generation with
identical twins arriving at random moments (some leaving early), and in some turns a revised
request under the same turn id that supersedes the generation mid-stream; once on a proxy
that finds every generation healthy (twins follow), once on one that finds every one stalled
(each twin supersedes the one before). Every client's answer is checked (CONTRACT 2-3):

- it holds events of one generation only (the upstream tags each generation's tokens),
  from the first token, in order, without gap or duplicate;
- a client of a generation that nothing newer replaced gets it whole, ending in [DONE];
  a twin of a healthy generation never fences it (one upstream request per turn);
- when a revised request arrives, every client of the old generation still reading (the
  first one and its followers) ends with the superseded frame, never [DONE];
- afterwards: every upstream closed or finished, no lease, no generation, no buffer left.

STREAMFENCE_FOLLOW_TURNS (default 150) turns at once; STREAMFENCE_STRESS_SEED pins the seed.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import httpx
import pytest

from tests.conftest import ProxyFactory
from tests.scripted import ScriptedUpstream, Seen
from tests.sse_client import Event, events
from tests.stress import harness
from tests.stress.schedules import driver_client

pytestmark = pytest.mark.stress

TURNS = int(os.environ.get("STREAMFENCE_FOLLOW_TURNS", "150"))
SEED = int(os.environ.get("STREAMFENCE_STRESS_SEED", str(random.randrange(1 << 32))))
CHAT = "/v1/chat/completions"
TOKEN = re.compile(r"^g(\d+):(\d+) $")


@dataclass
class Client:
    name: str
    leave_after: int | None = None  # events, then the client goes
    events: list[Event] = field(default_factory=list)
    got: asyncio.Event = field(default_factory=asyncio.Event)
    source: str = ""

    async def read(self, response: httpx.Response) -> None:
        self.source = response.headers.get("x-streamfence-source", "")
        async for event in events(response):
            self.events.append(event)
            self.got.set()
            if self.leave_after is not None and len(self.events) >= self.leave_after:
                return

    async def until(self, n: int) -> None:
        async with asyncio.timeout(harness.WAIT_LIMIT):
            while len(self.events) < n:
                self.got.clear()
                await self.got.wait()

    def generations(self) -> set[int]:
        found = (TOKEN.match(e.text) for e in self.events)
        return {int(m.group(1)) for m in found if m}

    def check(self, tokens: int, superseded: bool) -> list[str]:
        texts = [TOKEN.match(e.text) for e in self.events if e.text]
        numbers = [int(m.group(2)) for m in texts if m]
        out = []
        if len(self.generations()) > 1:
            out.append(f"{self.name}: events of two generations {self.generations()}")
        if numbers != list(range(len(numbers))):
            out.append(f"{self.name}: tokens out of order or missing {numbers}")
        last = self.events[-1] if self.events else None
        if self.leave_after is not None:
            return out
        if superseded:
            if last is None or not last.is_error or "stream_superseded" not in last.data:
                out.append(f"{self.name}: live when superseded, but ended {last}")
        elif last is None or last.data != "[DONE]" or len(numbers) != tokens:
            out.append(f"{self.name}: expected the whole answer, got {numbers} then {last}")
        return out


async def _turn(
    n: int, rng: random.Random, http: httpx.AsyncClient, upstream: ScriptedUpstream, stalled: bool
) -> list[str]:
    """One turn: a first request, 1-3 identical twins, maybe a revision. On a proxy that finds
    every generation healthy the twins follow; on one that finds every one stalled
    (healthy_within = 0) each twin supersedes the generation before it."""
    tokens = rng.randint(3, 6)
    turn = {"X-Turn-Id": f"follow-{n}"}
    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": f"turn {n}"}],
        "script": {"tokens": tokens, "gated": True, "unique": True},
    }
    revise = rng.random() < 0.3
    async with AsyncExitStack() as stack:
        leader = Client(f"turn {n} leader")
        response = await stack.enter_async_context(
            http.stream("POST", CHAT, json=body, headers=turn)
        )
        seen = next(
            s for s in reversed(upstream.seen) if s.body and f'turn {n}"' in s.body.decode()
        )
        reading = [asyncio.create_task(leader.read(response))]
        clients = [leader]
        await leader.until(1)
        for t in range(rng.randint(1, 3)):
            seen.release(rng.randint(0, 1))
            twin = Client(f"turn {n} twin {t}", rng.choice([None, None, 1, 2]))
            twin_response = await stack.enter_async_context(
                http.stream("POST", CHAT, json=body, headers=turn)
            )
            reading.append(asyncio.create_task(twin.read(twin_response)))
            clients.append(twin)
            await twin.until(1)
        newer: Client | None = None
        if revise:
            changed = {**body, "messages": [{"role": "user", "content": f"turn {n}, revised"}]}
            newer = Client(f"turn {n} revised")
            newer_response = await stack.enter_async_context(
                http.stream("POST", CHAT, json=changed, headers=turn)
            )
            await seen.closed.wait()  # the old generation's upstream is closed at once
            reading.append(asyncio.create_task(newer.read(newer_response)))
        for asked in _asked(upstream, n):
            asked.release(1000)
        async with asyncio.timeout(harness.WAIT_LIMIT):
            await asyncio.gather(*reading)
    everyone = clients + ([newer] if newer is not None else [])
    if stalled:
        return _check_stalled(n, everyone, tokens, upstream)
    problems = [p for c in clients for p in c.check(tokens, superseded=revise)]
    if newer is not None:
        problems += newer.check(tokens, superseded=False)
        if newer.generations() & leader.generations():
            problems.append(f"turn {n}: the revised request got the old generation")
    if not all(c.source == "followed" for c in clients[1:]):
        problems.append(f"turn {n}: a twin of a healthy generation did not follow it")
    if len(_asked(upstream, n)) != 1 + revise:
        problems.append(f"turn {n}: {len(_asked(upstream, n))} upstream requests")
    return problems


def _asked(upstream: ScriptedUpstream, n: int) -> list[Seen]:
    marks = (f'turn {n}"'.encode(), f"turn {n}, revised".encode())
    return [s for s in upstream.seen if any(m in s.body for m in marks)]


def _check_stalled(
    n: int, everyone: list[Client], tokens: int, upstream: ScriptedUpstream
) -> list[str]:
    """Each request superseded the one before it: all but the last fenced, each its own
    generation, one upstream request each."""
    problems = []
    for i, client in enumerate(everyone):
        problems += client.check(tokens, superseded=i < len(everyone) - 1)
        if client.source != "upstream":
            problems.append(f"{client.name}: served as {client.source}, not as a new generation")
    generations = [g for c in everyone for g in c.generations()]
    if len(generations) != len(set(generations)):
        problems.append(f"turn {n}: two clients shared a generation {generations}")
    if len(_asked(upstream, n)) != len(everyone):
        problems.append(f"turn {n}: {len(_asked(upstream, n))} upstream requests")
    return problems


@pytest.mark.parametrize("stalled", [False, True], ids=["healthy", "stalled"])
async def test_twins_follow_and_revisions_fence_every_client_of_the_old_generation(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, stalled: bool
) -> None:
    rng = random.Random(SEED)
    seeds = [rng.randrange(1 << 32) for _ in range(TURNS)]
    options = {"upstream.healthy_within": 0.0 if stalled else 3600.0}
    async with make_proxy(upstream.url, **options) as proxy:
        async with driver_client(proxy.url, timeout=60) as http:
            results = await asyncio.gather(
                *(_turn(n, random.Random(s), http, upstream, stalled) for n, s in enumerate(seeds))
            )
        await proxy.runtime.wait_idle()
        runtime = proxy.runtime
        harness.assert_clean(runtime)
        assert len(runtime.generations or ()) == 0 and runtime.budget.used == 0
    problems = [p for turn in results for p in turn]
    left_open = [s for s in upstream.seen if not _over(s)]
    print(
        f"\nfollow stress (seed {SEED}): {TURNS} turns, {len(upstream.seen)} upstream requests, "
        f"{len(problems)} violations"
    )
    assert problems == [], problems[:20]
    assert left_open == []


def _over(seen: Seen) -> bool:
    return seen.finished or seen.broke or seen.closed.is_set()
