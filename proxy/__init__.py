"""streamfence: a local HTTP proxy that keeps one writer per LLM turn.

When an agent retries a stalled stream while the old one is still alive, the proxy fences
the older attempt: its upstream request is closed at once and its client gets a clear,
non-retryable error, so only the newest attempt's events reach a client.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
