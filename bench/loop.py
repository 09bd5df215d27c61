"""uvloop when it is installed (it is a dependency of uvicorn[standard]), else asyncio."""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def raise_fd_limit() -> None:
    """B4 holds thousands of sockets per process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else hard
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def run_fast(coro: Coroutine[Any, Any, T]) -> T:
    raise_fd_limit()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
