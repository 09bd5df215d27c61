"""Which generation a request joins: the process's table of live generations by turn, and the
rule of CONTRACT section 3 that picks between following, starting anew and going beside.

    identical body, same streaming mode, generation healthy   -> follow (no upstream request)
    identical body, same mode, generation stalled             -> new generation (supersedes)
    identical body, other streaming mode, generation healthy  -> beside (fences nobody)
    identical body, other streaming mode, generation stalled  -> new generation (supersedes)
    a different body under the same explicit turn id          -> new generation (supersedes)

`on_retry = "join"` follows a stalled generation too; `"supersede"` always starts anew.
`decide` is pure (the clock is an argument); `Generations` holds the table.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import httpx

from proxy.registry import Lease, Registry
from proxy.turn.buffer import Budget
from proxy.turn.generation import Generation
from proxy.upstream.client import UpstreamClient

if TYPE_CHECKING:
    from proxy.registry.genlog.log import GenerationLog
    from proxy.registry.redis import Follow

NEW: Final = "new"
FOLLOW: Final = "follow"
BESIDE: Final = "beside"
NOTHING_LEFT: Final = "nothing_left"  # a resume at the very end of a completed generation
STALE: Final = "stale"  # a retry of a body the running generation replaced: refused
KEPT: Final = 4096  # turns whose last generation the table remembers, per memory
# How long a turn remembers the versions its generations replaced, after they are over: a
# client that retries a 409 with backoff (the Vercel AI SDK: 2 s, then 4 s) must not get an
# answer to the old version once the new one has finished, a second writer for the turn.
RETIRED_SECONDS: Final = 120.0


@dataclass(frozen=True, slots=True)
class Ask:
    """What a generation asks upstream, and how it may be shared."""

    request: httpx.Request
    upstream: str  # the upstream's name
    key: str | None  # the turn key; None: never fenced, never fences
    body_hash: str | None  # what "an identical request" means
    streaming: bool  # the request's streaming mode
    max_event_bytes: int
    buffer_bytes: int  # per generation; over it nobody may follow any more
    stamp_ids: bool  # add `id: <token>-<n>` to every SSE event (for Last-Event-ID)
    followable: bool  # kept for followers (False: keyless, beside, on_retry = supersede)
    retain_for: float = 0.0  # seconds a completed generation stays replayable (replay_window)
    dialect: str = "sse"  # the caller's (proxy.wire.dialects): which events are keep-alives
    # The bodies of the turn that this generation (or one before it) replaced: a retry of
    # one of them must not replace it in turn.
    retired: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Policy:
    on_retry: str  # adaptive | supersede | join
    healthy_within: float
    replay_fingerprints: bool


@dataclass(frozen=True, slots=True)
class Attempt:
    """What decides a request's place: its body's identity and how it asks."""

    body_hash: str | None
    streaming: bool
    explicit: bool  # the turn key came from an explicit turn id
    last_event_id: bytes | None


@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # new | follow | beside | nothing_left | stale
    generation: Generation | None = None  # the one to follow, or the one a new one replaces
    cursor: int = 0  # follow from after this event number
    how: str = "upstream"  # upstream | followed | resumed | replayed | beside
    refused: str = ""  # why an identical request could not follow (logged, counted)
    replaced_by: int | None = None  # stale: the attempt that replaced the version it repeats


def decide(live: Generation | None, attempt: Attempt, policy: Policy, now: float) -> Decision:
    if live is None or live.fenced or live.closing or attempt.body_hash is None:
        return Decision(NEW)  # (closing: its last client left; its upstream is going)
    ask = live.ask
    identical = ask.body_hash == attempt.body_hash
    if not identical and attempt.body_hash in ask.retired:
        return Decision(STALE, live, replaced_by=None if live.lease is None else live.lease.attempt)
    if policy.on_retry == "supersede" or not identical:
        return Decision(NEW, live)
    resume = live.cursor_after(attempt.last_event_id)
    if live.done:
        if live.completed and resume is not None and resume == live.last_id:
            return Decision(NOTHING_LEFT, live)
        replayable = attempt.explicit or resume is not None or policy.replay_fingerprints
        same_mode = ask.streaming == attempt.streaming
        if not (live.completed and live.retained and replayable and same_mode):
            return Decision(NEW, live)
        return Decision(FOLLOW, live, resume or 0, "replayed")
    healthy = live.healthy(policy.healthy_within, now)
    if ask.streaming != attempt.streaming:
        return Decision(BESIDE, how="beside") if healthy else Decision(NEW, live)
    if not live.followable:
        return Decision(NEW, live, refused="buffer_over_cap")
    if healthy or policy.on_retry == "join":
        return Decision(FOLLOW, live, resume or 0, "followed" if resume is None else "resumed")
    return Decision(NEW, live)


class Generations:
    """The live generations of one process, by turn key, under one byte budget."""

    def __init__(
        self,
        client: UpstreamClient,
        registry: Registry | None,
        budget: Budget,
        log: GenerationLog | None = None,
    ) -> None:
        self.client = client
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
        """A new generation of `ask` (`lease`: its turn claimed already)."""
        generation = Generation(
            ask, self.client, self.registry, self.budget, self._ended, log=self.log, lease=lease
        )
        if ask.followable and ask.key is not None:
            self._live[ask.key] = generation
        return generation

    def follow_remote(self, ask: Ask, current: Follow) -> Generation:
        """Follow the turn's generation in another process, through its log; later
        identical requests here follow this one."""
        from proxy.registry.redis import RedisRegistry  # noqa: PLC0415
        from proxy.turn.remote import RemoteGeneration  # noqa: PLC0415 - the Redis backend only

        assert isinstance(self.registry, RedisRegistry) and ask.key is not None
        generation = RemoteGeneration(
            ask, current, self.registry, self.client, self.budget, self._ended
        )
        self._live[ask.key] = generation
        return generation

    def _ended(self, generation: Generation) -> None:
        key = generation.ask.key
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
