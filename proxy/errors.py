"""The project's exception tree.

Third-party exceptions (httpx, redis) are translated into these at one boundary each
(`proxy.upstream.client` and `proxy.registry.redisio`); `proxy.turn.writes` turns them into
responses in one place, in the caller's dialect (its frames mid-stream: `proxy.wire.dialects`).

    StreamfenceError             status  code
    ├── BadRequest                 400   bad_request       (invalid X-Turn-Id, ...)
    ├── Unauthorized               401   unauthorized      (missing/wrong access token)
    ├── NoRoute                    404   no_route          (path matches no upstream)
    ├── UpgradeUnavailable         426   websocket_unavailable (a WebSocket that cannot be relayed)
    ├── BodyTooLarge               413   body_too_large
    ├── Superseded                 409   stream_superseded (a newer attempt of the turn won)
    │   └── StaleRetry             409   stream_superseded (a retry of an attempt already replaced)
    ├── RegistryUnavailable        503   registry_unavailable (fail_closed only)
    ├── GenerationLost             502   generation_lost   (a followed generation's log ended
    │                                                       without its end: writer gone, ...)
    ├── ShuttingDown               503   shutting_down
    └── UpstreamError              502   upstream_error
        ├── UpstreamConnectError   502   upstream_unreachable
        ├── UpstreamTimeout        504   upstream_timeout
        └── MalformedStream        502   malformed_stream
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class StreamfenceError(Exception):
    status: int = 500
    code: str = "internal_error"
    # The official SDKs retry 408/409/429/5xx unless told not to; only errors that a
    # retry could fix leave it to them.
    retryable: bool = False
    # The answer broke off upstream (or in the process that read it): a body already begun
    # ends after the error event without its terminator, as it would without the proxy, so
    # that no client takes the truncated answer for a whole one (CONTRACT section 5). The
    # proxy's own endings (superseded, shutting down) end the body cleanly.
    cuts_body: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(StreamfenceError):
    status = 400
    code = "bad_request"


class Unauthorized(StreamfenceError):
    status = 401
    code = "unauthorized"


class NoRoute(StreamfenceError):
    status = 404
    code = "no_route"


class UpgradeUnavailable(StreamfenceError):
    """A WebSocket upgrade that cannot be relayed (upstream unreachable): 426, so that
    clients fall back to HTTP at once instead of retrying."""

    status = 426
    code = "websocket_unavailable"


class BodyTooLarge(StreamfenceError):
    status = 413
    code = "body_too_large"


class Superseded(StreamfenceError):
    status = 409
    code = "stream_superseded"

    def __init__(self, attempt: int, newer: int | None = None) -> None:
        super().__init__(superseded_message(attempt, newer))
        self.attempt = attempt


class StaleRetry(Superseded):
    """A request repeating a version of the turn that a newer one replaced while that newer
    one is still answering: refused, since taking it as the newest would cut the winner
    (clients that retry a 409 whatever it says, such as the Vercel AI SDK, send these)."""

    def __init__(self, newer: int | None) -> None:
        StreamfenceError.__init__(
            self,
            "streamfence: this request repeats an earlier version of this turn, which was "
            f"superseded by {'attempt ' + str(newer) if newer else 'a newer attempt'} of the "
            "same turn; that attempt is still delivering the answer. Do not retry this request.",
        )
        self.attempt = 0


class RegistryUnavailable(StreamfenceError):
    status = 503
    code = "registry_unavailable"
    retryable = True


class GenerationLost(StreamfenceError):
    """A generation followed through the shared log cannot be read to its end.

    `reason`: "writer_gone" (its process stopped sending heartbeats), "lost" (Redis lost
    the log: restarted or evicted), "trimmed" (the events asked for are no longer kept),
    "not_found" (no such log), "unavailable" (Redis unreachable). A retry is the remedy:
    it starts (or follows) a newer generation.
    """

    status = 502
    code = "generation_lost"
    retryable = True
    cuts_body = True

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ShuttingDown(StreamfenceError):
    status = 503
    code = "shutting_down"
    retryable = True


class UpstreamError(StreamfenceError):
    status = 502
    code = "upstream_error"
    retryable = True
    cuts_body = True
    kind = "protocol"  # a metrics label: which fault it was

    def __init__(self, message: str, cause: str = "") -> None:
        super().__init__(message)
        # For the request's log line, not the client: what failed and where
        # ("127.0.0.1:8080: connection refused"), never a credential.
        self.cause = cause


class UpstreamConnectError(UpstreamError):
    code = "upstream_unreachable"
    kind = "connect"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"
    kind = "timeout"


class MalformedStream(UpstreamError):
    code = "malformed_stream"
    kind = "malformed"
    retryable = False


def superseded_message(attempt: int, newer: int | None = None) -> str:
    # Plain words, and none that agents read as a transient network fault
    # (CONTRACT section 4): a retry here would fence the winner.
    by = f"attempt {newer}" if newer else "a newer attempt"
    return (
        f"streamfence: attempt {attempt} of this turn was superseded by {by} of the same "
        "turn, which is now the only one delivering the answer. Do not retry this request."
    )


def chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what caused it (`__cause__`, else `__context__`) and the members of any
    group, breadth first, each once: a chain set by hand may loop (`raise e from e`)."""
    seen: set[int] = set()
    todo = deque([error])
    while todo:
        current = todo.popleft()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        following = current.__cause__ or current.__context__
        if following is not None:
            todo.append(following)


def kept(error: E) -> E:
    """`error`, to be kept on an object that outlives the raise (a generation, a client), without
    the tracebacks of its chain: their frames refer back to that object, a cycle that only the
    garbage collector would free (docs/history/benchmarks-2026-12.md, "the host, and garbage"). What
    is logged of an error is its type, message and cause (`proxy.upstream.causes`), never its
    frames."""
    for link in chain(error):
        link.__traceback__ = None
    return error
