"""What the WebSocket modules share: a message's data, a task run beside the relay, and what
the fence needs of the session it fences (`FenceSession`).

The session holds its fence and the fence drives its session (writes to the client, closes
the upstream socket): the fence depends on this Protocol, not on the session's module, so the
two do not import each other.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from proxy.runtime import Runtime
from proxy.websocket.upgrade import Upgrade

Data = str | bytes  # one WebSocket message: text or binary
Task = Callable[..., Coroutine[Any, Any, None]]


class FenceSession(Protocol):
    """What `proxy.websocket.fence.ResponsesFence` calls on its session
    (`proxy.websocket.session.Session`)."""

    @property
    def rt(self) -> Runtime: ...

    @property
    def upgrade(self) -> Upgrade: ...

    async def send_client(self, data: Data) -> None:
        """Write one message to the client (the fence's error events)."""

    async def forward(self, data: Data | None) -> None:
        """Send upstream; None: only the fence's `resend`, on a new upstream socket."""

    def spawn(self, fn: Task, *args: Any) -> None:
        """Run `fn` beside the relay, or in the session's final cleanup once it is over."""

    def close_later(self, code: int, reason: str) -> None:
        """Close the client with `code`, from a task of its own."""

    def retire_upstream_now(self) -> None:
        """Close the upstream socket at once: stops a superseded generation."""
