"""This process's leases in the shared registry (proxy/registry/book.py), pure: what a claim,
answered or heard, does to them."""

from __future__ import annotations

from proxy.registry.base import Lease
from proxy.registry.book import Book


def test_an_answered_claim_fences_the_local_holder_it_replaces() -> None:
    book = Book()
    old = Lease("k", 10, 1)
    assert book.claimed(old, 0) is False  # nothing held before
    new = Lease("k", 11, 2)
    assert book.claimed(new, 10) is True  # it replaced this process's own
    assert old.superseded and old.newer_attempt == 2
    assert not new.superseded and book.holders() == [new]


def test_a_later_claim_answered_first_fences_the_earlier_one_on_arrival() -> None:
    book = Book()
    later = Lease("k", 12, 3)
    book.claimed(later, 0)
    earlier = Lease("k", 11, 2)  # Redis gave it the lower token: it is the older attempt
    book.claimed(earlier, 0)
    assert earlier.superseded and earlier.newer_attempt == 3
    assert not later.superseded and book.holders() == [later]


def test_a_claim_heard_fences_the_holder_and_followed_generations_it_outranks() -> None:
    book = Book()
    mine, followed, newer_followed = Lease("k", 10, 1), Lease("k", 9, 1), Lease("k", 20, 4)
    book.claimed(mine, 0)
    book.watch(followed)
    book.watch(newer_followed)
    assert book.heard("k", 15, 3, 10) is True  # it replaced mine: fenced here
    assert mine.superseded and followed.superseded and not newer_followed.superseded
    book.unwatch(newer_followed)
    book.heard("k", 30, 5, 20)
    assert not newer_followed.superseded  # no longer watched


def test_a_claim_heard_elsewhere_leaves_other_keys_and_newer_holders_alone() -> None:
    book = Book()
    here, other = Lease("k", 10, 1), Lease("j", 5, 1)
    book.claimed(here, 0)
    book.claimed(other, 0)
    assert book.heard("k", 8, 2, 7) is False  # older than the holder, replacing nobody here
    assert not here.superseded and not other.superseded


def test_a_released_lease_is_still_known_as_fenced_and_ours() -> None:
    book = Book()
    lease = Lease("k", 10, 1)
    book.claimed(lease, 0)
    assert len(book) == 1
    assert book.released(lease) is True
    assert book.released(lease) is False  # once
    assert len(book) == 0 and book.holders() == []
    assert book.ours(("k", 10)) and not book.ours(("k", 11))
    # Another process's claim that replaced it: confirmed as fenced, though it is gone.
    assert book.heard("k", 11, 2, 10) is True


def test_a_key_stays_live_until_every_lease_claimed_for_it_is_released() -> None:
    book = Book()
    first, second = Lease("k", 10, 1), Lease("k", 11, 2)
    book.claimed(first, 0)
    book.claimed(second, 10)
    book.released(second)
    assert len(book) == 1  # the superseded first one is still streaming its frame
    book.released(first)
    assert len(book) == 0


def test_a_claim_heard_for_the_very_lease_held_or_followed_here_fences_nothing() -> None:
    # Every process hears its own claims on the channel, and a follower hears the claim of
    # the generation it follows: neither may fence the lease that claim made.
    book = Book()
    mine, followed = Lease("k", 5, 1), Lease("j", 7, 2)
    book.claimed(mine, 0)
    book.watch(followed)
    assert book.heard("k", 5, 1, 0) is False
    assert book.heard("j", 7, 2, 0) is False
    assert not mine.superseded and not followed.superseded
    assert book.holders() == [mine]


def test_an_answered_claim_fences_the_local_holder_even_when_it_replaced_another_process() -> None:
    # This process holds 10; another process claimed 11 (not heard yet); this process's
    # claim is answered as 12, replacing 11: its own older lease is fenced all the same.
    book = Book()
    old = Lease("k", 10, 1)
    book.claimed(old, 0)
    new = Lease("k", 12, 3)
    assert book.claimed(new, 11) is False  # 11 was not this process's
    assert old.superseded and old.newer_attempt == 3
    assert book.holders() == [new]


def test_an_answered_claim_fences_the_other_processes_generations_followed_here() -> None:
    book = Book()
    followed = Lease("k", 5, 1)
    book.watch(followed)
    book.claimed(Lease("k", 9, 2), 5)
    assert followed.superseded and followed.newer_attempt == 2


def test_a_claim_heard_fences_the_holder_it_outranks_whatever_it_replaced() -> None:
    # A claim heard from another process replaced a claim in between (missed here): this
    # process's holder is older than it all the same.
    book = Book()
    mine = Lease("k", 10, 1)
    book.claimed(mine, 0)
    assert book.heard("k", 15, 3, 12) is False  # 12 was not this process's
    assert mine.superseded and mine.newer_attempt == 3


def test_unwatching_one_followed_generation_keeps_the_others_of_its_key_watched() -> None:
    book = Book()
    first, second = Lease("k", 5, 1), Lease("k", 6, 2)
    book.watch(first)
    book.watch(second)
    book.unwatch(first)
    book.heard("k", 9, 3, 6)
    assert second.superseded and not first.superseded
    book.unwatch(second)
    book.unwatch(second)  # twice: nothing left to forget
    assert book._watched == {}  # and no emptied set per key left behind: nothing leaks
