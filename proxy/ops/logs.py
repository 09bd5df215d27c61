"""The one log line per finished request (from its `proxy.ops.record.Record`), and the
process's log format. Never a credential or a body.

`configure(level, fmt)` routes every logger of the process (streamfence's, uvicorn's error and
access loggers, asyncio's, anything else through the root) to one stderr handler. In "json"
mode every line is one JSON object with `ts` (RFC 3339, UTC), `level`, `logger` and `msg`;
request and supersede lines add their fields. In "text" mode lines stay for humans. "auto",
the default, is text on a terminal and JSON otherwise (`resolve_format`).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import fields
from types import TracebackType
from typing import IO, Any

from proxy.config.schema import LogFormat
from proxy.ops.record import Record

_TEXT = LogFormat.TEXT  # bound once: see proxy/turn/rule.py NEW (every request line)
logger = logging.getLogger("streamfence")
# Marks a record whose message is already a whole line in the configured format (the
# request and supersede lines): the formatters pass it through. One shared dict, so the
# hot path allocates nothing for it.
_WHOLE_LINE = {"streamfence_line": True}


# The raw clock readings are logged as the durations derived from them.
_CLOCKS = {"started", "forwarded_at", "upstream_headers_at", "first_byte_at", "finished_at"}
_LOGGED = tuple(
    f.name for f in fields(Record) if f.name not in _CLOCKS | {"fence_latency", "trace", "usage"}
)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def line(record: Record, fmt: LogFormat = LogFormat.JSON) -> str:
    # Every field is a plain value: read them directly (asdict deep-copies, per request).
    data: dict[str, object] = {name: getattr(record, name) for name in _LOGGED}
    data.update(
        ttfb_ms=_ms(record.ttfb),
        duration_ms=_ms(record.duration),
        fence_latency_ms=_ms(record.fence_latency),
    )
    usage = record.usage
    if usage is not None:  # the kinds the provider reported: input_tokens, output_tokens, ...
        data["response_model"] = usage.model
        data.update((f"{kind.value}_tokens", n) for kind, n in usage.counts())
    return _render("request", data, fmt)


_second: list[Any] = [None, ""]  # the last whole second formatted, and its text


def rfc3339(ts: float) -> str:
    """UTC, milliseconds: 2026-12-01T08:10:30.123Z."""
    second = int(ts // 1)  # as gmtime rounds: down
    if _second[0] != second:  # strftime once a second, not once a line
        _second[:] = [second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))]
    return f"{_second[1]}.{int(ts % 1 * 1000):03d}Z"


def _render(msg: str, data: dict[str, object], fmt: LogFormat) -> str:
    stamp = rfc3339(time.time())
    if fmt == _TEXT:
        # For humans: the time first, empty fields left out, values with spaces quoted.
        shown = [f"{k}={_quote(v)}" for k, v in data.items() if v not in (None, "", False)]
        return " ".join([stamp, f"msg={msg}", *shown])
    head: dict[str, object] = {"ts": stamp, "level": "info", "logger": logger.name, "msg": msg}
    return _dumps(head | data)


def _line_encoder() -> Callable[[dict[str, object]], str]:
    """`json.dumps` with its defaults, for a flat dict of plain values: the json module's
    C encoder made once (json.dumps makes one per call: a third of a line's cost), and
    without the check for cycles, which a dict of strings and numbers cannot have."""
    make = getattr(json.encoder, "c_make_encoder", None)  # not in typeshed
    if make is None:  # a Python without the json module's C part
        return json.dumps
    encode = make(
        None,  # no cycle check
        json.JSONEncoder().default,  # what cannot be written raises TypeError, as before
        json.encoder.encode_basestring_ascii,
        None,  # no indent
        ": ",
        ", ",
        False,  # sort_keys
        False,  # skipkeys
        True,  # allow_nan
    )
    return lambda data: "".join(encode(data, 0))


_dumps = _line_encoder()


def _quote(value: object) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c in text for c in ' "=') else text


class LineSink:
    """The request and supersede lines, written to the process's log stream together, once
    per event-loop iteration: one write for all the requests that ended in it, without a
    `LogRecord` and the handler's lock for each (about a tenth of a short request's CPU, and
    bursts: bench B5's 200 load streams end within a few milliseconds). It writes only while
    the process's one handler is `configure`'s own; with any other handler (a test's log
    capture, an application's) the lines go through `logging` like any other record."""

    def __init__(self, handler: logging.StreamHandler[Any]) -> None:
        self.handler = handler
        self.lines: list[str] = []
        # Weakly: the sink outlives loops (a test's, a restarted app's), and a closed loop kept
        # alive here is freed only when the next loop replaces it, by the collector.
        self._loop: weakref.ref[asyncio.AbstractEventLoop] | None = None
        self._scheduled = False

    def owns_output(self) -> bool:
        return logging.getLogger().handlers == [self.handler] and not logger.handlers

    def write(self, text: str) -> None:
        self.lines.append(text)
        loop = self._loop() if self._loop is not None else None
        if self._scheduled and loop is not None and not loop.is_closed():
            return  # its flush comes at the end of this iteration
        if loop is None or loop.is_closed():  # (a flush a closed loop never ran: the lines wait)
            try:  # kept: looking the loop up is a getpid() system call on Python 3.11
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: nothing to batch with
                self.flush()
                return
            self._loop = weakref.ref(loop)
        self._scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        lines, self.lines = self.lines, []
        if not lines:
            return
        handler = self.handler
        handler.acquire()
        try:
            handler.stream.write("\n".join(lines) + handler.terminator)
            handler.flush()
        except (OSError, ValueError):  # stderr closed or gone: nowhere left to say so
            pass
        finally:
            handler.release()


_sink: LineSink | None = None


def _emit(text: str) -> None:
    sink = _sink
    if sink is not None and sink.owns_output():
        sink.write(text)
    else:
        logger.info(text, extra=_WHOLE_LINE)


def flush() -> None:
    """Write the lines still waiting for their loop iteration (at exit, or a test's now)."""
    if _sink is not None:
        _sink.flush()


def log_request(record: Record, fmt: LogFormat = LogFormat.JSON) -> None:
    if logger.isEnabledFor(logging.INFO):
        _emit(line(record, fmt))


def supersede_line(record: Record, fmt: LogFormat = LogFormat.JSON) -> str:
    """Both attempts of a supersede, and how long the fence took to close the old one."""
    data: dict[str, object] = {
        "turn": record.turn,
        "attempt": record.attempt,
        "by_attempt": record.superseded_by,
        "upstream": record.upstream,
        "request_id": record.request_id,
        "fence_latency_ms": _ms(record.fence_latency),
    }
    return _render("superseded", data, fmt)


def log_supersede(record: Record, fmt: LogFormat = LogFormat.JSON) -> None:
    if logger.isEnabledFor(logging.INFO):
        _emit(supersede_line(record, fmt))


# --- the process's log format ------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per record, whoever logged it."""

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "streamfence_line", False):
            return record.getMessage()
        data: dict[str, object] = {
            "ts": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            exc_type, exc, tb = record.exc_info
            data["error"] = f"{getattr(exc_type, '__name__', 'Exception')}: {exc}"
            data["traceback"] = "".join(traceback.format_exception(exc_type, exc, tb))
        elif record.stack_info:
            data["traceback"] = record.stack_info
        return json.dumps(data, default=str)


class TextFormatter(logging.Formatter):
    """The message alone for information (request lines carry their own time), the level
    in front of warnings and errors; tracebacks as Python prints them."""

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "streamfence_line", False):
            return record.getMessage()
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname}: {text}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def _log_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    logger.critical("uncaught exception", exc_info=(exc_type, exc, tb))


# uvicorn's own loggers: "uvicorn.error" (startup, protocol errors, exceptions in the app)
# and "uvicorn.access" (off by default: the request line replaces it).
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


def _refused_upgrade(record: logging.LogRecord) -> bool:
    # uvicorn says this at ERROR for every WebSocket upgrade the proxy refuses on purpose
    # with an HTTP response (426, or the upstream's own refusal): not an error of ours.
    return record.getMessage() != "ASGI callable returned without completing handshake."


def resolve_format(fmt: LogFormat, stream: IO[str]) -> LogFormat:
    """The format "auto" means for `stream`: text for a person at a terminal, JSON for
    whatever collects the output (a pipe, a file, a container runtime)."""
    if fmt != LogFormat.AUTO:
        return fmt
    try:
        return LogFormat.TEXT if stream.isatty() else LogFormat.JSON
    except (AttributeError, ValueError):  # no stream, or a closed one
        return LogFormat.JSON


def configure(level: str, fmt: LogFormat) -> None:
    global _sink
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == LogFormat.JSON else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    flush()  # what the previous handler's sink still held
    _sink = LineSink(handler)
    root.setLevel(logging.WARNING)  # third-party libraries: their warnings and errors only
    logger.handlers.clear()
    logger.setLevel(level.upper())
    logger.propagate = True
    # The startup lines say where it listens, the shutdown lines what a stop waits for:
    # shown whatever the level.
    logging.getLogger("streamfence.startup").setLevel(logging.INFO)
    logging.getLogger("streamfence.shutdown").setLevel(logging.INFO)
    # uvicorn's information lines repeat the startup lines: only its problems, unless debug.
    uvicorn_level = logging.DEBUG if level.lower() == "debug" else logging.WARNING
    for name in UVICORN_LOGGERS:
        log = logging.getLogger(name)
        log.handlers.clear()
        log.propagate = True
        log.setLevel(uvicorn_level)
    logging.getLogger("uvicorn.error").addFilter(_refused_upgrade)
    # Python's warnings and uncaught exceptions (main thread or any other) as log records
    # too, so that in JSON mode not even a traceback breaks the one-object-per-line rule.
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda args: _log_uncaught(
        args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback
    )
    # One log line per request is on the hot path: skip what no format shows, the
    # caller's frame, thread and process (the logging HOWTO's "Optimization" section).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


atexit.register(flush)  # the last iteration's lines, at a normal exit
