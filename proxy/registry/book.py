"""This process's leases in the shared registry, and what a claim does to them.

`RedisRegistry` talks to Redis; `Book` keeps what the process holds: the newest lease per
turn key, every lease claimed here and not yet released, the ones released lately, and the
generations of other processes followed here. A claim, this process's own (answered) or
another's (heard on the channel), is applied here in one place: every lease it replaces is
superseded in the same step, so that the per-event fence check stays a local attribute
read. Pure and I/O-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.registry.base import Lease
from proxy.registry.listener import Recent

# A lease named across processes: tokens are unique per turn key (see `connection`).
Ref = tuple[str, int]


def ref(lease: Lease) -> Ref:
    return (lease.key, lease.token)


@dataclass(slots=True)
class _Local:
    holder: Lease  # the newest lease this process holds for the key
    live: int  # claimed here and not yet released, superseded ones included


class Book:
    def __init__(self) -> None:
        self._local: dict[str, _Local] = {}
        self._by_ref: dict[Ref, Lease] = {}  # claimed here and not yet released
        self.ended: Recent[Ref] = Recent()  # released here: confirmed as fenced if asked
        self._watched: dict[str, set[Lease]] = {}  # other processes' generations followed

    def __len__(self) -> int:
        """The keys with a lease claimed here and not yet released."""
        return len(self._local)

    def watch(self, lease: Lease) -> None:
        self._watched.setdefault(lease.key, set()).add(lease)

    def unwatch(self, lease: Lease) -> None:
        watched = self._watched.get(lease.key)
        if watched is not None:
            watched.discard(lease)
            if not watched:
                del self._watched[lease.key]

    def claimed(self, lease: Lease, prev: int) -> bool:
        """This process's claim was answered: `lease` replaced the key's holder `prev`.
        True when `prev` was this process's own (and is now fenced)."""
        key = lease.key
        self._by_ref[ref(lease)] = lease
        self._fence_watched(key, lease.token, lease.attempt)
        local = self._local.get(key)
        if local is None:
            self._local[key] = _Local(lease, 1)
        else:
            local.live += 1
            if local.holder.token < lease.token:
                local.holder.supersede(newer_attempt=lease.attempt)
                local.holder = lease
            else:  # a later claim of this process was answered first
                lease.supersede(newer_attempt=local.holder.attempt)
        return self._fence(key, prev, lease.attempt)

    def heard(self, key: str, token: int, attempt: int, prev: int) -> bool:
        """A claim made anywhere (this process included) for `key`, replacing `prev`.
        True when `prev` is fenced here: this process's own, or released here."""
        local = self._local.get(key)
        if local is not None and local.holder.token < token:
            local.holder.supersede(newer_attempt=attempt)
        self._fence_watched(key, token, attempt)
        return self._fence(key, prev, attempt) or (key, prev) in self.ended

    def _fence(self, key: str, prev: int, attempt: int) -> bool:
        replaced = self._by_ref.get((key, prev))
        if replaced is None:
            return False
        replaced.supersede(newer_attempt=attempt)
        return True

    def _fence_watched(self, key: str, token: int, attempt: int) -> None:
        for watched in list(self._watched.get(key, ())):
            if watched.token < token:
                watched.supersede(newer_attempt=attempt)

    def released(self, lease: Lease) -> bool:
        """`lease` is released here; False when it was already."""
        if self._by_ref.pop(ref(lease), None) is None:
            return False
        self.ended.add(ref(lease))
        local = self._local.get(lease.key)
        if local is not None:
            local.live -= 1
            if local.live <= 0:
                del self._local[lease.key]
        return True

    def ours(self, claim: Ref) -> bool:
        """`claim` was made by this process."""
        return claim in self._by_ref or claim in self.ended

    def holders(self) -> list[Lease]:
        """The newest lease of each key held here, unless it is superseded already."""
        return [local.holder for local in self._local.values() if not local.holder.superseded]
