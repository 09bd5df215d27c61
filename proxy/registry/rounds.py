"""Many script calls in one round trip to Redis: `send_round`, and `Batcher`, which sends
the calls of many callers (claims, releases) together.

redis-py spends more CPU per command than the rest of a claim, about half of it the system call that
writes it; in a pipeline each command costs a fraction of that (docs/history/benchmarks-2026-12.md,
"Redis under load"). A process under load makes many calls at once, so batching them costs nothing
when it is quiet (a round of one is one command) and saves most of the cost when it is busy, which
is when the cost matters.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from proxy.errors import RegistryUnavailable
from proxy.registry.redisio import Call, Client, run_scripts, translate, unavailable
from proxy.tasks import cancelled

log = logging.getLogger("streamfence")

ROUNDS = 4  # a Batcher's rounds in flight at once: a call waits for a free one, not a slot


async def send_round(client: Client, calls: list[Call], what: str) -> list[Any]:
    """Each call's reply, or the RegistryUnavailable that failed it (all of them, when the
    round itself failed)."""
    try:
        with translate(what):
            replies = await run_scripts(client, calls)
    except RegistryUnavailable as exc:
        return [exc] * len(calls)
    except Exception as exc:  # a bug: logged, and no caller is left waiting on it
        log.exception("streamfence: a round of Redis calls failed")
        return [unavailable(what, exc)] * len(calls)
    return [unavailable(what, r) if isinstance(r, BaseException) else r for r in replies]


class Batcher:
    """Script calls submitted by many callers, sent in rounds: up to ROUNDS at once, and
    what is submitted while they are all in flight goes together in the next."""

    def __init__(self, client: Client, what: str) -> None:
        self.client = client
        self.what = what  # named in errors: "claim", "release"
        self._queue: list[tuple[Call, asyncio.Future[Any]]] = []
        self._rounds: set[asyncio.Task[None]] = set()

    def submit(self, call: Call) -> asyncio.Future[Any]:
        """The call's reply, or its RegistryUnavailable. Cancelling the future does not
        take the call back: it may have been sent."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((call, future))
        if len(self._rounds) < ROUNDS:
            task = loop.create_task(self._run())
            self._rounds.add(task)
            task.add_done_callback(self._rounds.discard)
        return future

    async def close(self) -> None:
        await cancelled(list(self._rounds))

    async def _run(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            replies: list[Any] = []
            try:
                replies = await send_round(self.client, [call for call, _ in batch], self.what)
            finally:
                if not replies:  # cancelled: the registry is closing
                    replies = [RegistryUnavailable("streamfence: the registry is closing")] * len(
                        batch
                    )
                for (_, future), reply in zip(batch, replies, strict=True):
                    if future.done():
                        continue  # its caller was cancelled
                    if isinstance(reply, BaseException):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)
