"""The ASGI shapes the proxy speaks, named once: messages, the send and receive callables,
and raw header lists."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]
Headers = list[tuple[bytes, bytes]]
