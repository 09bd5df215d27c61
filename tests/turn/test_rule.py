"""follow.decide, the rule of CONTRACT section 3, as a table: pure, no I/O, no clock. And
what the table of generations remembers of a turn once its generation is gone."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from proxy.registry import MemoryRegistry
from proxy.turn import rule as follow
from proxy.turn.ask import Ask as RealAsk
from proxy.turn.buffer import Budget
from proxy.turn.rule import Attempt, Decision, Policy
from proxy.turn.table import KEPT, Generations, _remember
from proxy.upstream.client import UpstreamClient


@dataclass
class Ask:
    body_hash: str = "A"
    streaming: bool = True
    retired: frozenset[str] = frozenset()


@dataclass
class Live:
    """What decide reads of a generation."""

    ask: Ask = field(default_factory=Ask)
    fenced: bool = False
    closing: bool = False  # its last client left and its upstream is being closed
    done: bool = False
    completed: bool = False
    retained: bool = False
    followable: bool = True
    quiet: float = 0.0  # seconds since its last sign of life
    last_id: int = 5
    lease: Any = None

    def healthy(self, within: float, now: float) -> bool:
        return self.quiet < within

    def cursor_after(self, last_event_id: bytes | None) -> int | None:
        return 3 if last_event_id == b"own-3" else None


def decide(live: Live | None, policy: str = "adaptive", **attempt: Any) -> Decision:
    a = Attempt(
        attempt.get("body", "A"),
        attempt.get("streaming", True),
        attempt.get("explicit", True),
        attempt.get("last_event_id"),
    )
    return follow.decide(live, a, Policy(policy, 10.0, False), now=0.0)  # type: ignore[arg-type]


HEALTHY, STALLED = Live(), Live(quiet=11.0)


@pytest.mark.parametrize(
    ("live", "policy", "attempt", "action", "how"),
    [
        (None, "adaptive", {}, "new", "upstream"),
        (HEALTHY, "adaptive", {}, "follow", "followed"),
        (STALLED, "adaptive", {}, "new", "upstream"),
        (STALLED, "join", {}, "follow", "followed"),
        (HEALTHY, "supersede", {}, "new", "upstream"),
        (HEALTHY, "adaptive", {"streaming": False}, "beside", "beside"),
        (STALLED, "adaptive", {"streaming": False}, "new", "upstream"),
        (HEALTHY, "join", {"streaming": False}, "beside", "beside"),
        (HEALTHY, "adaptive", {"body": "B"}, "new", "upstream"),
        (HEALTHY, "join", {"body": "B"}, "new", "upstream"),
        (HEALTHY, "adaptive", {"last_event_id": b"own-3"}, "follow", "resumed"),
        (HEALTHY, "adaptive", {"last_event_id": b"junk"}, "follow", "followed"),
        (Live(fenced=True), "adaptive", {}, "new", "upstream"),
        (Live(closing=True), "adaptive", {}, "new", "upstream"),
        (Live(followable=False), "adaptive", {}, "new", "upstream"),
        (Live(ask=Ask(retired=frozenset({"B"}))), "adaptive", {"body": "B"}, "stale", "upstream"),
        (Live(ask=Ask(retired=frozenset({"B"}))), "supersede", {"body": "B"}, "stale", "upstream"),
        (Live(done=True, completed=True, retained=True), "adaptive", {}, "follow", "replayed"),
        (
            Live(done=True, completed=True, retained=True),
            "adaptive",
            {"explicit": False},
            "new",
            "upstream",
        ),
        # A replay is of the same streaming mode: a non-streaming fallback gets JSON.
        (
            Live(done=True, completed=True, retained=True),
            "adaptive",
            {"streaming": False},
            "new",
            "upstream",
        ),
        (Live(done=True, completed=True), "adaptive", {}, "new", "upstream"),
        (Live(done=True, retained=True), "adaptive", {}, "new", "upstream"),
        (
            Live(done=True, completed=True, last_id=3),
            "adaptive",
            {"last_event_id": b"own-3"},
            "nothing_left",
            "upstream",
        ),
    ],
)
def test_the_rule(
    live: Live | None, policy: str, attempt: dict[str, Any], action: str, how: str
) -> None:
    decision = decide(live, policy, **attempt)
    assert (decision.action, decision.how) == (action, how)
    if action == "follow":
        assert decision.generation is live
        assert decision.cursor == (3 if attempt.get("last_event_id") == b"own-3" else 0)


def test_an_identical_request_that_cannot_follow_says_why() -> None:
    assert decide(Live(followable=False)).refused == "buffer_over_cap"
    assert decide(HEALTHY).refused == ""


def test_a_request_without_a_body_identity_is_always_new() -> None:
    assert decide(HEALTHY, body=None).action == "new"


class _Answers(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=httpx.ByteStream(b'{"ok": true}'))


async def test_a_refusal_of_a_replaced_version_expires_after_120_seconds() -> None:
    # A generation of the edited version of a turn, which replaced the "old" one, over a
    # transport that answers at once; nobody reads it: it ends, and the table forgets it
    # but for the versions it replaced.
    table = Generations(UpstreamClient(_Answers()), MemoryRegistry(), Budget(1 << 20))
    ask = RealAsk(
        request=httpx.Request("POST", "http://upstream.test/v1/chat/completions", json={}),
        upstream="up",
        key="turn",
        body_hash="edited",
        streaming=False,
        max_event_bytes=1 << 20,
        buffer_bytes=1 << 20,
        stamp_ids=False,
        followable=True,
        retired=frozenset({"old"}),
    )
    generation = table.start(ask)
    await asyncio.wait_for(generation.finished.wait(), 5)
    for _ in range(100):  # its release runs in the background, a few steps later
        if not len(table):
            break
        await asyncio.sleep(0)
    assert len(table) == 0
    ended = time.monotonic()
    retry = Attempt("old", False, True, None)
    policy = Policy("adaptive", 10.0, False)
    # 120 s, as docs/contract.md promises (a client retrying a 409 with backoff): the
    # literal, not the constant, so that a change of the promise is a change of this test.
    for later in (0.0, 119.0):
        assert table.decide("turn", retry, policy, ended + later).action == "stale"
    assert table.decide("turn", retry, policy, ended + 121.0).action == "new"
    # Another version of the turn was never refused.
    assert table.decide("turn", Attempt("other", False, True, None), policy, ended).action == "new"


def test_the_table_remembers_the_most_recent_turns_and_no_more() -> None:
    memory: OrderedDict[str, int] = OrderedDict()
    for n in range(KEPT):
        _remember(memory, str(n), n)
    _remember(memory, "0", -1)  # remembered again: now the most recent
    _remember(memory, "new", 1)  # one too many: the least recent goes
    assert len(memory) == KEPT
    assert "1" not in memory and memory["0"] == -1 and list(memory)[-2:] == ["0", "new"]
