"""The follow rule (CONTRACT section 3): what a request does when its turn already has a
generation running. Pure: the clock is an argument.

    identical body, same streaming mode, generation healthy   -> follow (no upstream request)
    identical body, same mode, generation stalled             -> new generation (supersedes)
    identical body, other streaming mode, generation healthy  -> beside (fences nobody)
    identical body, other streaming mode, generation stalled  -> new generation (supersedes)
    a different body under the same explicit turn id          -> new generation (supersedes)

`on_retry = "join"` follows a stalled generation too; `"supersede"` always starts anew.

`retry` is the rule's core, the one the three places that judge a repeated request share:
`decide` (a request against a generation of this process), the WebSocket twin rule
(proxy/websocket/fence.py: a socket cannot follow, so a follow is a twin beside) and, as a
copy in Lua that cannot call Python, the Redis script that follows across processes
(proxy/registry/scripts.py CLAIM_OR_FOLLOW). One table of cases checks all three
(tests/turn/test_rule_table.py). `decide` adds what only a generation of this process has:
its buffer (resumes, replays, a buffer over its cap) and the versions it replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from proxy.config.schema import OnRetry
from proxy.ops.record import Source
from proxy.turn.generation import Generation


class Action(StrEnum):
    """Where a request goes."""

    NEW = "new"  # a new generation (superseding the running one, if any)
    FOLLOW = "follow"  # the running generation's events: no upstream request
    BESIDE = "beside"  # a generation of its own beside the running one: nobody fenced
    NOTHING_LEFT = "nothing_left"  # a resume from the very end of a completed generation
    STALE = "stale"  # a retry of a version the running generation replaced: refused


# The members the rule and the table use for every request, bound to module names: on Python
# 3.11 each `Action.NEW` goes through EnumType.__getattr__'s hook, about a thousand
# instructions (3.12 made it a plain lookup); a module name is one dict lookup.
NEW, FOLLOW, BESIDE = Action.NEW, Action.FOLLOW, Action.BESIDE
NOTHING_LEFT, STALE = Action.NOTHING_LEFT, Action.STALE
_SUPERSEDE, _JOIN = OnRetry.SUPERSEDE, OnRetry.JOIN


@dataclass(frozen=True, slots=True)
class Policy:
    """An upstream's settings that the rule reads."""

    on_retry: OnRetry
    healthy_within: float
    replay_fingerprints: bool

    @property
    def shares(self) -> bool:
        """Its generations may be followed (on_retry is not supersede)."""
        return self.on_retry != _SUPERSEDE


@dataclass(slots=True)  # (not frozen: per request; see table.Placed)
class Attempt:
    """What decides a request's place: its body's identity and how it asks."""

    body_hash: str | None
    streaming: bool
    explicit: bool  # the turn key came from an explicit turn id
    last_event_id: bytes | None


@dataclass(slots=True)  # (not frozen: per request; see table.Placed)
class Decision:
    action: Action
    generation: Generation | None = None  # the one to follow, or the one a new one replaces
    cursor: int = 0  # follow from after this event number
    how: Source = Source.UPSTREAM
    refused: str = ""  # why an identical request could not follow (logged, counted)
    replaced_by: int | None = None  # stale: the attempt that replaced the version it repeats


def retry(identical: bool, same_mode: bool, healthy: bool, on_retry: OnRetry) -> Action:
    """What a repeated request does to its turn's running generation: the rule's core.

    `identical`: the same canonical body; `same_mode`: the same streaming mode; `healthy`:
    the generation sent content within healthy_within (proxy/wire/health.py)."""
    if on_retry == _SUPERSEDE or not identical:
        return NEW
    if not same_mode:
        # Never the other mode's body: beside a healthy one, else it replaces the stalled one.
        return BESIDE if healthy else NEW
    return FOLLOW if healthy or on_retry == _JOIN else NEW


def decide(live: Generation | None, attempt: Attempt, policy: Policy, now: float) -> Decision:
    """Where `attempt` goes, given its turn's generation in this process (`now`: monotonic)."""
    if live is None or live.fenced or live.closing or attempt.body_hash is None:
        return Decision(NEW)  # (closing: its last client left; its upstream is going)
    ask = live.ask
    identical = ask.body_hash == attempt.body_hash
    if not identical and attempt.body_hash in ask.retired:
        replaced_by = None if live.lease is None else live.lease.attempt
        return Decision(STALE, live, replaced_by=replaced_by)
    if policy.on_retry == _SUPERSEDE or not identical:
        return Decision(NEW, live)
    resume = live.cursor_after(attempt.last_event_id)
    same_mode = ask.streaming == attempt.streaming
    if live.done:
        return _after_the_end(live, attempt, policy, resume, same_mode)
    action = retry(True, same_mode, live.healthy(policy.healthy_within, now), policy.on_retry)
    if action is BESIDE:
        return Decision(BESIDE, how=Source.BESIDE)
    if action is NEW:
        return Decision(NEW, live)
    if not live.followable:
        return Decision(NEW, live, refused="buffer_over_cap")
    how = Source.FOLLOWED if resume is None else Source.RESUMED
    return Decision(FOLLOW, live, resume or 0, how)


def _after_the_end(
    live: Generation, attempt: Attempt, policy: Policy, resume: int | None, same_mode: bool
) -> Decision:
    """An identical request for a generation whose reader is done: a replay of a completed,
    retained one (replay_window), in the same mode, that may be replayed; else anew."""
    if live.completed and resume is not None and resume == live.last_id:
        return Decision(NOTHING_LEFT, live)
    replayable = attempt.explicit or resume is not None or policy.replay_fingerprints
    if not (live.completed and live.retained and replayable and same_mode):
        return Decision(NEW, live)
    return Decision(FOLLOW, live, resume or 0, Source.REPLAYED)
