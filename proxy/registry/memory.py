"""The in-memory registry: one process, no I/O."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from proxy.registry.base import Lease, Registry


@dataclass(slots=True)
class _Entry:
    holder: Lease
    # Tokens claimed and not yet released, superseded ones included. A set, not a count, so
    # that releasing a lease twice (or one of the key's previous life) frees nothing else.
    live: set[int]


class MemoryRegistry(Registry):
    def __init__(self) -> None:
        self._tokens = itertools.count(1)
        self._entries: dict[str, _Entry] = {}

    async def claim(self, key: str) -> Lease:
        return self.claim_now(key)

    def claim_now(self, key: str) -> Lease:
        entry = self._entries.get(key)
        if entry is None:
            lease = Lease(key, next(self._tokens), 1)
            self._entries[key] = _Entry(lease, {lease.token})
            return lease
        old = entry.holder
        lease = Lease(key, next(self._tokens), old.attempt + 1)
        entry.holder = lease
        entry.live.add(lease.token)
        old.supersede(newer_attempt=lease.attempt)
        return lease

    async def release(self, lease: Lease) -> None:
        entry = self._entries.get(lease.key)
        if entry is None:
            return
        entry.live.discard(lease.token)
        if not entry.live:
            del self._entries[lease.key]

    def live_keys(self) -> int:
        return len(self._entries)
