"""What a generation asks upstream, and how it may be shared: made once per request that goes
upstream (proxy/server/endpoint.py), after its place is known (proxy/turn/table.py)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx


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
    model: str | None = None  # the model the request names (the ledger's, with the answer's)
    # The bodies of the turn that this generation (or one before it) replaced: a retry of
    # one of them must not replace it in turn.
    retired: frozenset[str] = frozenset()
