"""What the lifespan creates and every request shares: the configuration, the registry,
the upstream client, the generations, metrics, the status board and the requests in flight.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Protocol

from proxy.config.schema import Config
from proxy.errors import ShuttingDown, StreamfenceError
from proxy.ops import logs, status, tracing
from proxy.ops.ledger import Ledger
from proxy.ops.metrics import Metrics
from proxy.ops.record import FOLLOWER_SOURCES, Outcome, Record
from proxy.registry import Registry
from proxy.turn.buffer import Budget
from proxy.turn.rule import Policy
from proxy.turn.table import Generations
from proxy.upstream.client import UpstreamClient
from proxy.upstream.routing import Router
from proxy.wire.usage import Usage

ACCESS_TOKEN_HEADER = b"x-streamfence-token"
_COMPLETED = Outcome.COMPLETED  # bound once: see proxy/turn/rule.py NEW


class Abortable(Protocol):
    """What the shutdown drain (proxy/server/shutdown.py) ends: with an error, at its next
    await, in its dialect."""

    def abort(self, error: ShuttingDown) -> None: ...


class InFlight(Abortable, Protocol):
    """A request in flight: an HTTP client of a generation (`proxy.turn.relay.Subscriber`) or a
    WebSocket attempt. The shutdown drain aborts it; the status page reads its record."""

    record: Record

    def last_alive(self) -> float | None:
        """When what it reads last sent content (time.monotonic), for the status page."""
        ...

    def usage(self) -> Usage | None:
        """What its answer has reported it cost so far, for the status page."""
        ...


class Runtime:
    """One per app; its upstream client and generations are made in the lifespan."""

    def __init__(self, config: Config, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.router = Router(config.upstream)
        self.metrics = Metrics()
        self.ledger = Ledger(self.metrics, config.server.max_model_labels)
        registry.unavailable_hook = self.metrics.registry_unavailable.inc
        self.client: UpstreamClient | None = None
        self.turn_header = config.turns.header.lower().encode("latin-1")
        self.drop_headers = {self.turn_header, ACCESS_TOKEN_HEADER}
        self.token = config.server.access_token.encode()
        self.active: set[InFlight] = set()  # in flight: for the status page and shutdown
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        self.budget = Budget(config.server.join_buffer_total_bytes)
        self.generations: Generations | None = None  # with the client, in the lifespan
        self.status = status.StatusBoard((up.name for up in config.upstream), self.ledger)
        self.tracer = tracing.create(config.tracing)  # None unless tracing is on
        self.policies = {
            up.name: Policy(up.on_retry, up.healthy_within, up.replay_fingerprints)
            for up in config.upstream
        }

    def begin(self, request: InFlight) -> None:
        self.active.add(request)
        self._idle.clear()
        self.status.changed()

    def end(self, request: InFlight) -> None:
        self.active.discard(request)
        if not self.active:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until every relay in flight has finished (lease released, record observed):
        a client may hold its whole response a moment before that."""
        await self._idle.wait()

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        if not self.token:
            return True
        given = next((v for n, v in headers if n == ACCESS_TOKEN_HEADER), b"")
        return hmac.compare_digest(given, self.token)

    def finished(self, record: Record, error: StreamfenceError | None) -> None:
        kind = getattr(error, "kind", None)
        record.cause = getattr(error, "cause", "")
        self.metrics.observe(record, kind)
        if record.source in FOLLOWER_SOURCES and record.outcome == _COMPLETED:
            # a whole answer, without a request of its own
            self.ledger.served(record.upstream, record.model, record.usage)
        self.metrics.in_flight.dec()
        if record.fenced_generation:  # once per generation, not per follower
            logs.log_supersede(record, self.config.server.log_format)
        logs.log_request(record, self.config.server.log_format)
        self.status.finished(record, error)
        if self.tracer is not None:
            self.tracer.end(record)
