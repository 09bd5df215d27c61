"""proxy.registry.memory: fencing tokens, supersede callbacks and attempt numbers, plus a
hypothesis state machine over claim/release checking the single-writer bookkeeping."""

from __future__ import annotations

from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from proxy.registry.base import Lease
from proxy.registry.memory import MemoryRegistry

T = TypeVar("T")


def now(coro: Coroutine[Any, Any, T]) -> T:
    """Run a registry call that must not suspend: the memory registry does no I/O."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("the memory registry suspended")


def claim(reg: MemoryRegistry, key: str) -> Lease:
    return now(reg.claim(key))


def release(reg: MemoryRegistry, lease: Lease) -> None:
    now(reg.release(lease))


def test_tokens_strictly_increase_and_never_repeat() -> None:
    reg = MemoryRegistry()
    tokens = []
    for round_ in range(3):
        leases = [claim(reg, key) for key in ("a", "b", "a", "c", "a")]
        tokens += [lease.token for lease in leases]
        for lease in leases:
            release(reg, lease)
        assert reg.live_keys() == 0, round_
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)


def test_claim_supersedes_the_previous_holder_and_runs_its_callbacks_once() -> None:
    reg = MemoryRegistry()
    first = claim(reg, "k")
    calls: list[str] = []
    first.on_superseded(lambda: calls.append("one"))
    first.on_superseded(lambda: calls.append("two"))
    assert not first.superseded
    second = claim(reg, "k")
    assert calls == ["one", "two"]
    assert first.superseded
    assert first.newer_attempt == 2 and first.superseded_at is not None
    assert not second.superseded
    third = claim(reg, "k")
    first.supersede(newer_attempt=9)  # idempotent: nothing runs twice, nothing changes
    assert calls == ["one", "two"]
    assert first.newer_attempt == 2
    assert second.superseded and second.newer_attempt == 3
    assert not third.superseded


def test_other_keys_are_never_touched() -> None:
    reg = MemoryRegistry()
    a, b = claim(reg, "a"), claim(reg, "b")
    claim(reg, "a")
    assert a.superseded and not b.superseded
    assert reg.live_keys() == 2


def test_on_superseded_after_the_fact_runs_at_once() -> None:
    reg = MemoryRegistry()
    old = claim(reg, "k")
    claim(reg, "k")
    calls: list[int] = []
    old.on_superseded(lambda: calls.append(1))
    assert calls == [1]


def test_a_callback_may_register_another_while_running() -> None:
    reg = MemoryRegistry()
    old = claim(reg, "k")
    calls: list[str] = []
    old.on_superseded(lambda: old.on_superseded(lambda: calls.append("nested")))
    claim(reg, "k")
    assert calls == ["nested"]


def test_release_of_an_older_lease_never_fences_or_frees_the_newest() -> None:
    reg = MemoryRegistry()
    old = claim(reg, "k")
    new = claim(reg, "k")
    release(reg, old)
    assert not new.superseded
    assert reg.live_keys() == 1
    # The key is still held, so the next claim is attempt 3 and fences `new`.
    newest = claim(reg, "k")
    assert newest.attempt == 3 and new.superseded


def test_releasing_twice_frees_nothing_else() -> None:
    reg = MemoryRegistry()
    old = claim(reg, "k")
    new = claim(reg, "k")
    release(reg, old)
    release(reg, old)  # e.g. a second cleanup path: must not count as `new` ending
    assert reg.live_keys() == 1
    newer = claim(reg, "k")
    assert new.superseded and newer.attempt == 3


def test_a_stale_lease_from_the_keys_previous_life_frees_nothing() -> None:
    reg = MemoryRegistry()
    stale = claim(reg, "k")
    release(reg, stale)
    assert reg.live_keys() == 0
    current = claim(reg, "k")
    release(reg, stale)
    assert reg.live_keys() == 1
    newer = claim(reg, "k")
    assert current.superseded, "a retry must still fence the attempt in flight"
    assert newer.attempt == 2


def test_attempts_count_up_while_any_attempt_is_live_and_restart_once_none_is() -> None:
    reg = MemoryRegistry()
    one = claim(reg, "k")
    two = claim(reg, "k")
    release(reg, two)  # the newest ended, the superseded one has not yet
    three = claim(reg, "k")
    assert [one.attempt, two.attempt, three.attempt] == [1, 2, 3]
    release(reg, one)
    release(reg, three)
    assert reg.live_keys() == 0
    again = claim(reg, "k")
    assert again.attempt == 1
    assert again.token > three.token  # attempts restart, tokens never do


def test_release_of_an_unknown_lease_is_harmless() -> None:
    reg = MemoryRegistry()
    release(reg, Lease("never-claimed", 99, 1))
    assert reg.live_keys() == 0


def test_lease_repr_shows_only_a_prefix_of_the_key() -> None:
    reg = MemoryRegistry()
    key = "f" * 64
    lease = claim(reg, key)
    assert key not in repr(lease) and "current" in repr(lease)
    claim(reg, key)
    assert "superseded" in repr(lease)


def test_ready_and_lifecycle_hooks() -> None:
    reg = MemoryRegistry()
    now(reg.start())
    assert now(reg.ready()) is True
    now(reg.close())


# --- the state machine ------------------------------------------------------------------


class Fencing(RuleBasedStateMachine):
    """Any interleaving of claims and releases (double releases included) on a few keys."""

    def __init__(self) -> None:
        super().__init__()
        self.reg = MemoryRegistry()
        self.claimed: list[Lease] = []  # in claim order
        self.released: set[int] = set()  # tokens
        self.calls: Counter[int] = Counter()  # token -> supersede callbacks run

    def live(self, key: str | None = None) -> list[Lease]:
        return [
            lease
            for lease in self.claimed
            if lease.token not in self.released and (key is None or lease.key == key)
        ]

    @rule(key=st.sampled_from(["a", "b", "c"]))
    def do_claim(self, key: str) -> None:
        before = self.live(key)
        previous = [lease for lease in self.claimed if lease.key == key]
        lease = claim(self.reg, key)
        token = lease.token
        lease.on_superseded(lambda: self.calls.update([token]))
        # Every attempt in flight for the key is fenced, with its callbacks run once.
        for old in before:
            assert old.superseded
            assert self.calls[old.token] == 1
        assert not lease.superseded
        assert lease.attempt == (previous[-1].attempt + 1 if before else 1)
        self.claimed.append(lease)

    @precondition(lambda self: self.claimed)
    @rule(data=st.data())
    def do_release(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(self.claimed))  # released ones too
        states = [(lease.token, lease.superseded) for lease in self.claimed]
        release(self.reg, lease)
        self.released.add(lease.token)
        # Releasing never fences anyone.
        assert [(lease.token, lease.superseded) for lease in self.claimed] == states

    @precondition(lambda self: self.claimed)
    @rule(data=st.data())
    def subscribe_late(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(self.claimed))
        ran: list[int] = []
        lease.on_superseded(lambda: ran.append(1))
        assert ran == ([1] if lease.superseded else [])

    @invariant()
    def tokens_unique_and_increasing(self) -> None:
        tokens = [lease.token for lease in self.claimed]
        assert tokens == sorted(set(tokens))

    @invariant()
    def one_current_lease_per_key_and_it_is_the_newest(self) -> None:
        for key in ("a", "b", "c"):
            current = [lease for lease in self.live(key) if not lease.superseded]
            assert len(current) <= 1
            if current:
                newest = [lease for lease in self.claimed if lease.key == key][-1]
                assert current[0] is newest
            # Every lease older than the newest live one is fenced.
            live = self.live(key)
            if live:
                for lease in live[:-1]:
                    assert lease.superseded

    @invariant()
    def callbacks_ran_once_for_exactly_the_superseded(self) -> None:
        for lease in self.claimed:
            assert self.calls[lease.token] == (1 if lease.superseded else 0)

    @invariant()
    def live_keys_counts_keys_with_a_live_attempt(self) -> None:
        assert self.reg.live_keys() == len({lease.key for lease in self.live()})


Fencing.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_fencing_state_machine = Fencing.TestCase
