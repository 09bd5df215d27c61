"""The table of this process's live generations, by turn, and the one placement step:
where a request goes (`Generations.place`), decided by the follow rule (proxy/turn/rule.py)
against the turn's generation here, or, with generations of other processes published
(the Redis registry), against the turn's generation there, in one atomic step in Redis.

    place: rule.decide here -> follow | nothing left | stale | new or beside
           new, publishable  -> registry.claim_or_follow: follow there | beside | claimed
           new or beside     -> the request's Ask (built once), a generation started
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from proxy.errors import StaleRetry
from proxy.ops.record import Source
from proxy.registry import Follow, Lease, Registry
from proxy.turn.ask import Ask
from proxy.turn.buffer import Budget
from proxy.turn.generation import Generation
from proxy.turn.remote import RemoteGeneration, cursor_after
from proxy.turn.rule import (
    BESIDE,
    FOLLOW,
    NEW,
    NOTHING_LEFT,
    STALE,
    Attempt,
    Decision,
    Policy,
    decide,
)
from proxy.turn.tee import TeeFor
from proxy.upstream.client import UpstreamClient
from proxy.wire.turns import TurnKey
from proxy.wire.usage import Usage

if TYPE_CHECKING:
    from proxy.registry.genlog.log import GenerationLog

KEPT: Final = 4096  # turns whose last generation the table remembers, per memory
# How long a turn remembers the versions its generations replaced, after they are over: a
# client that retries a 409 with backoff (the Vercel AI SDK: 2 s, then 4 s) must not get an
# answer to the old version once the new one has finished, a second writer for the turn.
RETIRED_SECONDS: Final = 120.0

# The request's Ask, built by the caller once its place is known: whether it is keyed (a new
# generation of its turn; not beside one) and the versions of the turn it replaces.
AskFor = Callable[[bool, frozenset[str]], Ask]
_UPSTREAM = Source.UPSTREAM  # bound once: see rule.NEW


# What a generation that asked upstream cost, at its end: upstream, model, usage, fenced, the
# events it had relayed (proxy/ops/ledger.py `Ledger.answered`).
Answered = Callable[[str, str | None, Usage | None, bool, int], None]


class NothingLeft(Exception):
    """A resume from the last event of a completed generation: nothing more to send."""


@dataclass(slots=True)  # not frozen: a frozen dataclass sets each field through
class Placed:  # object.__setattr__, a few hundred instructions a field, every request
    """Where a request was placed: the generation its client reads, and how."""

    generation: Generation
    how: Source
    cursor: int = 0  # read from after this event number
    refused: str = ""  # why an identical request could not follow (counted)
    started: bool = False  # it started the generation (it went upstream)


class Generations:
    """The live generations of one process, by turn key, under one byte budget."""

    def __init__(
        self,
        client: UpstreamClient,
        registry: Registry,
        budget: Budget,
        log: GenerationLog | None = None,
        answered: Answered | None = None,
    ) -> None:
        self.client = client
        self.answered = answered  # told of each generation that asked upstream, at its end
        self.registry = registry
        self.budget = budget
        self.log = log  # where followable generations are published (other processes)
        self._live: dict[str, Generation] = {}
        # The final event id of recently completed generations (id-stamped ones only): a
        # resume from there has nothing left to receive (EventSource reconnects after the end).
        self._final: OrderedDict[str, bytes] = OrderedDict()
        # The versions each turn's last generation replaced, when it ended, its attempt.
        self._retired: OrderedDict[str, tuple[float, frozenset[str], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    def lookup(self, key: str) -> Generation | None:
        return self._live.get(key)

    async def place(
        self,
        turn: TurnKey | None,
        last_event_id: bytes | None,
        policy: Policy,
        ask_for: AskFor,
    ) -> Placed:
        """The one placement step: the generation the request reads. Raises NothingLeft
        (a resume after the very end) or StaleRetry (a retry of a replaced version)."""
        if turn is None:
            return Placed(self.start(ask_for(False, frozenset())), _UPSTREAM, started=True)
        explicit = turn.source == "header"
        attempt = Attempt(turn.body_fingerprint, turn.streaming, explicit, last_event_id)
        decision = self.decide(turn.key, attempt, policy, time.monotonic())
        if decision.action is FOLLOW:
            assert decision.generation is not None
            return Placed(decision.generation, decision.how, decision.cursor)
        if decision.action is NOTHING_LEFT:
            raise NothingLeft
        if decision.action is STALE:
            raise StaleRetry(decision.replaced_by)
        retired = _retired(decision.generation)
        lease, action = None, decision.action
        if action is NEW and self._publishes(turn, policy):
            assert turn.body_fingerprint is not None
            answer = await self.registry.claim_or_follow(
                turn.key,
                turn.body_fingerprint,
                turn.streaming,
                policy.healthy_within,
                policy.on_retry,
            )
            if isinstance(answer, Follow):  # the turn's generation in another process
                resume = cursor_after(answer, last_event_id)
                followed = self.follow_remote(ask_for(True, retired), answer)
                how = Source.FOLLOWED if resume is None else Source.RESUMED
                return Placed(followed, how, resume or 0)
            if isinstance(answer, Lease):
                lease = answer
            else:  # beside it: fences nobody, fenced by nobody
                action = BESIDE
        keyed = action is not BESIDE
        generation = self.start(ask_for(keyed, retired if keyed else frozenset()), lease)
        how = _UPSTREAM if keyed else Source.BESIDE
        return Placed(generation, how, refused=decision.refused, started=True)

    def _publishes(self, turn: TurnKey, policy: Policy) -> bool:
        """A new followable generation of `turn` is published for other processes: its
        place is decided against theirs, in Redis (`claim_or_follow`)."""
        return policy.shares and turn.body_fingerprint is not None and self.log is not None

    def decide(self, key: str, attempt: Attempt, policy: Policy, now: float) -> Decision:
        """`decide` against the turn's live generation; with none, what the table remembers
        of its last one: a resume from its final event, a repeat of a version it replaced."""
        live = self._live.get(key)
        if live is not None:
            return decide(live, attempt, policy, now)
        final = self._final.get(key)
        if final is not None and attempt.last_event_id is not None:
            if attempt.last_event_id.strip() == final:
                return Decision(NOTHING_LEFT)
        retired = self._retired.get(key)
        if retired is not None and attempt.body_hash is not None:
            ended, bodies, replaced_by = retired
            if now - ended < RETIRED_SECONDS and attempt.body_hash in bodies:
                return Decision(STALE, replaced_by=replaced_by)
        return Decision(NEW)

    def start(self, ask: Ask, lease: Lease | None = None) -> Generation:
        """A new generation of `ask` (`lease`: its turn claimed already, and its log made
        with the claim), with a tee if it is published."""
        tee = None if self.log is None else _tee(self.log, ask, opened=lease is not None)
        generation = Generation(
            ask, self.client, self.registry, self.budget, self._ended, lease=lease, tee=tee
        )
        if ask.followable and ask.key is not None:
            self._live[ask.key] = generation
        return generation

    def follow_remote(self, ask: Ask, current: Follow) -> Generation:
        """Follow the turn's generation in another process, through its log; later
        identical requests here follow this one."""
        assert ask.key is not None
        generation = RemoteGeneration(
            ask, current, self.registry, self.client, self.budget, self._ended
        )
        self._live[ask.key] = generation
        return generation

    def _ended(self, generation: Generation) -> None:
        ask = generation.ask
        if self.answered is not None and generation.asked_upstream:
            used = generation.meter.usage
            self.answered(ask.upstream, ask.model, used, generation.fenced, generation.last_id)
        key = ask.key
        if key is None or self._live.get(key) is not generation:
            return
        del self._live[key]
        if generation.ask.retired:
            attempt = 0 if generation.lease is None else generation.lease.attempt
            _remember(self._retired, key, (time.monotonic(), generation.ask.retired, attempt))
        if generation.completed and generation.ask.stamp_ids and generation.token is not None:
            _remember(self._final, key, generation.event_id(generation.last_id))


def _remember(memory: OrderedDict[str, Any], key: str, value: Any) -> None:
    """Keep `value` for `key`, the most recent of at most KEPT keys (expiry is the reader's)."""
    memory[key] = value
    memory.move_to_end(key)
    if len(memory) > KEPT:
        memory.popitem(last=False)


def _retired(replaced: Generation | None) -> frozenset[str]:
    """What a new generation replaces: the bodies a stale retry would repeat."""
    if replaced is None or replaced.done or replaced.ask.body_hash is None:
        return frozenset()
    return replaced.ask.retired | {replaced.ask.body_hash}


def _tee(log: GenerationLog, ask: Ask, *, opened: bool) -> TeeFor | None:
    """What publishes a followable generation for other processes: its log's writer, made
    once the generation holds its turn (the log is named by its token). `opened`: the claim
    made the log already."""
    if not ask.followable or ask.key is None:
        return None
    body_hash, streaming = ask.body_hash or "", ask.streaming
    return partial(log.writer, ask.key, body_hash=body_hash, streaming=streaming, opened=opened)
