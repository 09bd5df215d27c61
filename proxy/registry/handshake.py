"""The fence handshake between processes that share one Redis registry.

A claim is published on the registry's channel with the token of the holder it replaced.
Every process applies it to what it holds (`Book.heard`); the process that held the
replaced lease then publishes a confirmation, and a claimer whose predecessor lives in
another process waits for it (at most ACK_WAIT), so that, as within one process, no event of
the older attempt is started after the newer one is accepted.

A claim heard while one of this process's own claims of the same key is still waiting for
its reply may be that very claim: such claims are kept (`early`) and decided once the reply
is read. The newest of them may fence the claim itself; the fences they made are confirmed
only if another process made them (this process fenced its own in the claim's step).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NamedTuple

from proxy.registry.base import Lease
from proxy.registry.book import Book, Ref
from proxy.registry.listener import Recent

log = logging.getLogger("streamfence")

ACK_WAIT = 0.05  # the longest a claim waits for another process to confirm a fence


class Heard(NamedTuple):
    """A claim message: its token and attempt, and the lease it replaced, if that one was
    this process's and is fenced here (None: nothing here to confirm)."""

    token: int
    attempt: int
    prev: int | None


class Handshake:
    def __init__(self, book: Book, publish: Callable[[str], None], channel: str) -> None:
        self._book = book
        self._publish = publish  # a message on the channel, sent in the background
        self._channel = channel
        self.acked: Recent[Ref] = Recent()  # confirmed fenced by whichever process held them
        self._waiters: dict[Ref, list[asyncio.Future[None]]] = {}
        self._pending: dict[str, int] = {}  # claims in flight per key
        self._early: dict[str, list[Heard]] = {}  # heard for a key while one was pending

    # -- this process's claims ------------------------------------------------------------
    def claiming(self, key: str) -> None:
        self._pending[key] = self._pending.get(key, 0) + 1

    def newest_heard(self, key: str) -> Heard | None:
        """The newest claim heard for `key` while this process's claim of it was pending."""
        return max(self._early.get(key, ()), key=lambda heard: heard.token, default=None)

    def claimed(self, key: str) -> None:
        """A claim of `key` was answered (or failed). When none is pending any more, the
        claims heard meanwhile are decided, once its lease is on the books (a step later)."""
        left = self._pending[key] - 1
        if left:
            self._pending[key] = left
            return
        del self._pending[key]
        heard = self._early.pop(key, None)
        if heard:
            asyncio.get_running_loop().call_soon(self._ack_unless_ours, key, heard)

    async def confirmed(self, prev: Ref, lease: Lease) -> None:
        """Until the process holding `prev` (replaced by `lease`) says it is fenced."""
        if prev in self.acked:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(prev, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, ACK_WAIT)
        except TimeoutError:
            # Its process is gone, or cut off from Redis: nothing to wait for any longer.
            log.warning(
                "streamfence: turn %s: the older attempt's process did not confirm its fence "
                "within %d ms; going ahead",
                lease.key[:16],
                ACK_WAIT * 1000,
            )
        finally:
            waiters = self._waiters.get(prev, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._waiters.pop(prev, None)

    def ack(self, fenced: Ref) -> None:
        """Tell the claimer that replaced `fenced` that its attempt is fenced here."""
        self._publish(f"f {fenced[1]} {fenced[0]}")

    # -- the channel ------------------------------------------------------------------------
    def on_message(self, data: bytes) -> None:
        try:
            kind, _, rest = data.decode().partition(" ")
            if kind == "c":
                token, attempt, prev, key = rest.split(" ", 3)
                self.heard(int(token), int(attempt), int(prev), key)
            elif kind == "f":
                token, key = rest.split(" ", 1)
                self._confirmed_by_holder((key, int(token)))
        except (ValueError, UnicodeDecodeError):
            log.warning("streamfence: ignored a malformed message on %s", self._channel)

    def heard(self, token: int, attempt: int, prev: int, key: str) -> None:
        """A claim made anywhere (this process included) for `key`, replacing `prev`."""
        fenced = self._book.heard(key, token, attempt, prev)
        if key in self._pending:  # maybe our own claim, its reply not yet read
            self._early.setdefault(key, []).append(Heard(token, attempt, prev if fenced else None))
        elif fenced:
            self._ack_unless_ours(key, [Heard(token, attempt, prev)])

    def _ack_unless_ours(self, key: str, claims: list[Heard]) -> None:
        """Confirm the fence of `prev` to each claim made by another process. A claim of
        this process fenced its own predecessor in its own step: a message would only
        reach every process's subscriber for nothing (one per supersede, before)."""
        for claim in claims:
            if claim.prev is not None and not self._book.ours((key, claim.token)):
                self.ack((key, claim.prev))

    def _confirmed_by_holder(self, fenced: Ref) -> None:
        self.acked.add(fenced)
        for waiter in self._waiters.pop(fenced, []):
            if not waiter.done():
                waiter.set_result(None)
