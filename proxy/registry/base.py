"""The registry interface and the lease an accepted attempt holds.

A lease is claimed when the proxy accepts an attempt and released when its stream ends.
Claiming a key supersedes its current holder: the holder's callbacks run at once, in the
claimer's task, so the relay that owns the old attempt is cancelled without polling. The
per-event check is a local attribute read, never a round trip.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, NamedTuple

if TYPE_CHECKING:
    from proxy.config.schema import OnRetry
    from proxy.registry.genlog.log import GenerationLog


class Lease:
    __slots__ = ("_callbacks", "attempt", "key", "newer_attempt", "superseded_at", "token")

    def __init__(self, key: str, token: int, attempt: int) -> None:
        self.key = key
        self.token = token  # the fencing token: never repeats while the registry lives
        self.attempt = attempt  # shown to callers; restarts when the key has no live attempt
        self.superseded_at: float | None = None  # time.perf_counter() of the newer claim
        self.newer_attempt: int | None = None
        self._callbacks: list[Callable[[], object]] = []

    @property
    def superseded(self) -> bool:
        return self.superseded_at is not None

    def supersede(self, newer_attempt: int | None = None, at: float | None = None) -> None:
        """Mark this lease fenced and tell its holder. Idempotent."""
        if self.superseded_at is not None:
            return
        self.superseded_at = time.perf_counter() if at is None else at
        self.newer_attempt = newer_attempt
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_superseded(self, callback: Callable[[], object]) -> None:
        """Run `callback` when superseded; at once if that already happened."""
        if self.superseded_at is not None:
            callback()
        else:
            self._callbacks.append(callback)

    def forget(self) -> None:
        """Drop the callbacks: their holder is done with this lease (and they refer back to
        it, a cycle that only the garbage collector would free)."""
        self._callbacks.clear()

    def __repr__(self) -> str:
        state = "superseded" if self.superseded else "current"
        return f"Lease(key={self.key[:12]}, token={self.token}, attempt={self.attempt}, {state})"


class Follow(NamedTuple):
    """`claim_or_follow`'s answer: follow generation `token` of another process."""

    token: int
    attempt: int
    events: int  # published so far
    reader_id: str = ""  # registered as a reader of its log under this id, by the claim
    quiet: float = 0.0  # seconds since its last sign of life (proxy.wire.health), Redis's clock


class Beside:
    """`claim_or_follow`'s answer: go beside the turn's generation in another process (the
    same body in the other streaming mode, healthy): neither fence it nor be fenced by it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "BESIDE"


BESIDE: Final = Beside()


class Registry(ABC):
    """Hands out fencing tokens per turn key and fences older holders."""

    # Called once per request forwarded unfenced because the registry was unreachable
    # (fail_open); the app points it at its metrics.
    unavailable_hook: Callable[[], object] | None = None

    async def start(self) -> None:  # noqa: B027 - backends without a connection need no setup
        """Connect and subscribe; called once from the app's lifespan."""

    async def close(self) -> None:  # noqa: B027
        """Release connections; called once from the app's lifespan."""

    @abstractmethod
    async def claim(self, key: str) -> Lease:
        """Accept a new attempt for `key`, superseding the current holder if any."""

    def claim_now(self, key: str) -> Lease | None:
        """`claim`, in the caller's step, for a backend that needs no I/O for it; None
        from one that does (the caller then awaits `claim`)."""
        return None

    async def claim_or_follow(
        self, key: str, body_hash: str, streaming: bool, healthy_within: float, on_retry: OnRetry
    ) -> Lease | Follow | Beside:
        """`claim`, or, where generations of other processes are published (`generation_log`),
        follow the turn's generation there (`Follow`) or go beside it (`BESIDE`), decided in
        one atomic step by the follow rule (CONTRACT section 3). Without other processes
        there is nothing to follow: a claim."""
        return await self.claim(key)

    def watch(self, lease: Lease) -> None:  # noqa: B027 - nothing to watch in one process
        """Fence `lease`, a generation of another process followed here, as soon as a newer
        claim of its turn is heard."""

    def unwatch(self, lease: Lease) -> None:  # noqa: B027
        """Stop watching `lease` (its follower here ended)."""

    @abstractmethod
    async def release(self, lease: Lease) -> None:
        """The attempt ended. Removes the key only if `lease` still holds it."""

    @abstractmethod
    def live_keys(self) -> int:
        """How many keys this process holds leases for (for tests, metrics, readiness)."""

    async def ready(self) -> bool:
        """Fencing works fully: the backend answers, and claims of other processes reach
        this one. What a process that is not ready does is `on_unavailable`'s decision."""
        return True

    async def reachable(self) -> bool:
        """The backend answers at all (the startup check: subscriptions take a moment)."""
        return True

    def generation_log(self) -> GenerationLog | None:
        """Where generations are published for followers in other processes (None: nowhere)."""
        return None
