"""The request log (one line per finished request, JSON or text), the supersede line with
both attempts, request ids, and the startup lines: over real HTTP, with secrets in the
traffic that must never reach a log."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.config.load import load
from proxy.ops import logs
from proxy.ops.record import Record
from proxy.server import serve
from tests.conftest import ProxyFactory
from tests.scripted import ScriptedUpstream, free_port
from tests.sse_client import chat_body, events, events_of_a_cut_body, open_stream

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
SECRET = "sk-proj-LOGSECRET-0123456789abcdef"
TURN_ID = "turn-LOGSECRET-id"
BODY = "BODY-LOGSECRET-prompt text"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def json(self, msg: str) -> list[dict[str, Any]]:
        parsed = [json.loads(line) for line in self.lines]
        return [p for p in parsed if p["msg"] == msg]


@pytest.fixture
def log_lines() -> Iterator[Lines]:
    logger = logging.getLogger("streamfence")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


async def _supersede_once(proxy_url: str, upstream: ScriptedUpstream) -> None:
    headers = {"Authorization": f"Bearer {SECRET}", "X-Turn-Id": TURN_ID}
    async with (
        httpx.AsyncClient(base_url=proxy_url, timeout=10) as client,
        AsyncExitStack() as stack,
    ):
        a = await open_stream(
            stack, client, CHAT, chat_body(BODY, gated=True), {**headers, "x-request-id": "req-a"}
        )
        a_events = events(a)
        await anext(a_events)
        b = await client.post(
            CHAT, json=chat_body(BODY), headers={**headers, "x-request-id": "req-b"}
        )
        assert b.status_code == 200
        assert [e async for e in a_events][-1].json["error"]["code"] == "stream_superseded"


async def test_json_lines_for_each_request_and_the_supersede(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, log_lines: Lines
) -> None:
    async with make_proxy(upstream.url) as proxy:
        await _supersede_once(proxy.url, upstream)
    requests = {r["request_id"]: r for r in log_lines.json("request")}
    a, b = requests["req-a"], requests["req-b"]
    for line in (a, b):
        assert line["method"] == "POST" and line["path"] == CHAT
        assert line["upstream"] == "default" and line["dialect"] == "openai-chat"
        assert line["status"] == 200 and line["streaming"] is True
        assert line["turn"] == a["turn"] and re.fullmatch(r"[0-9a-f]{16}", line["turn"])
        assert line["ttfb_ms"] >= 0 and line["duration_ms"] >= line["ttfb_ms"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])  # RFC 3339
        assert (line["level"], line["logger"]) == ("info", "streamfence")
    assert (a["attempt"], a["outcome"], a["superseded_by"]) == (1, "superseded", 2)
    assert a["error"] == "stream_superseded" and a["fence_latency_ms"] < 50
    assert (b["attempt"], b["outcome"]) == (2, "completed")
    assert b["events"] == 5 and b["bytes_out"] > 0  # 3 tokens, the finish chunk, [DONE]

    (fenced,) = log_lines.json("superseded")
    assert fenced["turn"] == a["turn"] and fenced["upstream"] == "default"
    assert (fenced["attempt"], fenced["by_attempt"]) == (1, 2)
    assert fenced["request_id"] == "req-a"
    assert fenced["fence_latency_ms"] == a["fence_latency_ms"]

    everything = "\n".join(log_lines.lines)
    for secret in (SECRET, TURN_ID, "LOGSECRET", "prompt text"):
        assert secret not in everything


async def test_text_format_for_humans(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, log_lines: Lines
) -> None:
    async with make_proxy(upstream.url, **{"server.log_format": "text"}) as proxy:
        await _supersede_once(proxy.url, upstream)
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    assert len(log_lines.lines) == 3
    for line in log_lines.lines:
        assert re.match(stamp + " msg=(request|superseded) ", line), line
        assert "LOGSECRET" not in line
    (fenced,) = [line for line in log_lines.lines if "msg=superseded" in line]
    assert " attempt=1 by_attempt=2 " in fenced and "upstream=default" in fenced
    request_a = next(
        line for line in log_lines.lines if "msg=request" in line and "request_id=req-a" in line
    )
    assert "outcome=superseded" in request_a and f"path={CHAT}" in request_a


def test_text_values_with_spaces_are_quoted() -> None:
    record = Record(method="GET", path="/a b", upstream="u")
    line = logs.line(record, "text")
    assert 'path="/a b"' in line and "method=GET" in line


@pytest.mark.parametrize(
    "stamps",
    [
        # one second, then the next, then back: each line's own second, whatever came before
        [1764662400.0, 1764662400.999, 1764662401.0005, 1764662400.5],
        [0.0, 59.9999, 60.0, 86399.999, 86400.0],
        [-0.5, -0.0001, 0.25],  # before 1970: gmtime rounds down, so must the cache
    ],
)
def test_timestamps_are_rfc3339_utc_milliseconds_across_seconds(stamps: list[float]) -> None:
    for ts in stamps:
        expected = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts))
        assert logs.rfc3339(ts) == f"{expected}.{int(ts % 1 * 1000):03d}Z"


_SCALARS = st.one_of(
    st.text(),
    st.integers(),
    st.floats(),  # NaN and the infinities included: json.dumps writes them as NaN, Infinity
    st.booleans(),
    st.none(),
)


@given(st.dictionaries(st.text(), _SCALARS, max_size=30))
def test_a_line_is_written_exactly_as_json_dumps_would(data: dict[str, object]) -> None:
    assert logs._dumps(data) == json.dumps(data)


class _Stream(io.StringIO):
    """A log stream that counts its writes."""

    writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


@pytest.fixture
def sink(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[logs.LineSink, _Stream]]:
    """`logs.configure`'s handler and sink, writing to a test stream (`_alone` makes it the
    process's only handler: pytest adds its own for each test's call)."""
    stream = _Stream()
    line_sink = logs.LineSink(logging.StreamHandler(stream))
    monkeypatch.setattr(logs, "_sink", line_sink)
    # setLevel, not the attribute: the logger caches isEnabledFor's answers per level, and
    # only setLevel clears that cache (a test after one that logged at WARNING saw nothing).
    level = logs.logger.level
    logs.logger.setLevel(logging.INFO)
    yield line_sink, stream
    line_sink.flush()
    logs.logger.setLevel(level)


def _alone(sink: tuple[logs.LineSink, _Stream], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [sink[0].handler])


async def test_the_lines_of_requests_ending_in_one_loop_iteration_are_one_write(
    sink: tuple[logs.LineSink, _Stream], monkeypatch: pytest.MonkeyPatch
) -> None:
    _alone(sink, monkeypatch)
    _, stream = sink
    for i in range(3):
        logs.log_request(Record("POST", f"/v1/{i}"), "json")
    assert stream.writes == 0  # not yet: at the end of this iteration
    loop = asyncio.get_running_loop()
    next_iteration = loop.create_future()
    loop.call_soon(next_iteration.set_result, None)
    await next_iteration
    assert stream.writes == 1
    lines = stream.getvalue().splitlines()
    assert [json.loads(text)["path"] for text in lines] == ["/v1/0", "/v1/1", "/v1/2"]


def test_without_a_loop_a_line_is_written_at_once_and_flush_writes_what_waits(
    sink: tuple[logs.LineSink, _Stream], monkeypatch: pytest.MonkeyPatch
) -> None:
    _alone(sink, monkeypatch)
    line_sink, stream = sink
    logs.log_request(Record("GET", "/now"), "json")
    assert json.loads(stream.getvalue())["path"] == "/now"
    line_sink.lines.append("waiting")  # as if its iteration had not ended
    logs.flush()  # what atexit calls
    assert stream.getvalue().endswith("waiting\n")


def test_the_sink_keeps_no_finished_loop_alive(
    sink: tuple[logs.LineSink, _Stream], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loop the sink held was freed only when the next loop's first line replaced it, and
    # then by the collector (tests/turn/test_garbage.py found it as a request's garbage).
    _alone(sink, monkeypatch)
    line_sink, stream = sink
    loop = asyncio.new_event_loop()

    async def one_line() -> None:
        logs.log_request(Record("GET", "/in-a-loop"), "json")

    loop.run_until_complete(one_line())
    loop.close()
    gone = weakref.ref(loop)
    del loop
    assert gone() is None  # freed by reference counting, with nothing for the collector
    assert json.loads(stream.getvalue())["path"] == "/in-a-loop"


def test_with_another_handler_the_lines_go_through_logging(
    sink: tuple[logs.LineSink, _Stream],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # caplog adds its own handler: a capture (or an application's handler) sees every line.
    line_sink, stream = sink
    monkeypatch.setattr(logging.getLogger(), "handlers", [line_sink.handler, caplog.handler])
    with caplog.at_level(logging.INFO, "streamfence"):
        logs.log_request(Record("GET", "/captured"), "json")
    assert stream.writes == 1  # through logging, to the process's handler as well
    assert [json.loads(r.getMessage())["path"] for r in caplog.records] == ["/captured"]


async def test_request_ids_are_passed_upstream_and_returned(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, log_lines: Lines
) -> None:
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        given = await client.get("/v1/models", headers={"x-request-id": "caller-id-1"})
        made = await client.get("/v1/models")
        bad = await client.get("/v1/models", headers={"x-request-id": "x" * 200})
    assert given.headers["x-request-id"] == "caller-id-1"
    assert upstream.seen[0].headers["x-request-id"] == "caller-id-1"
    made_id = made.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made_id)
    assert upstream.seen[1].headers["x-request-id"] == made_id
    assert re.fullmatch(r"[0-9a-f]{32}", bad.headers["x-request-id"])  # too long: replaced
    ids = [line["request_id"] for line in log_lines.json("request")]
    assert ids[:2] == ["caller-id-1", made_id]


async def test_the_log_line_carries_the_callers_id_and_the_upstreams(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, log_lines: Lines
) -> None:
    # The client is given the upstream's x-request-id (SDKs read it as the provider's id),
    # and the log line names both, so that either id finds the line. Before, the log had
    # only the caller's (or the proxy's own) and the upstream's was in no log line.
    openai_id = {"x-request-id": "prov-8"}
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        given = await client.post(
            CHAT,
            json=chat_body("given", headers=openai_id),
            headers={"x-request-id": "my-req-42"},
        )
        made = await client.post(CHAT, json=chat_body("made", headers=openai_id))
        anthropic = await client.post(
            CHAT, json=chat_body("anthropic", headers={"request-id": "req_011"})
        )
        silent = await client.post(CHAT, json=chat_body("silent"))
    assert given.headers["x-request-id"] == made.headers["x-request-id"] == "prov-8"
    assert anthropic.headers["request-id"] == "req_011"
    sent = [seen.headers["x-request-id"] for seen in upstream.seen]
    assert sent[0] == "my-req-42" and re.fullmatch(r"[0-9a-f]{32}", sent[1])
    assert silent.headers["x-request-id"] == sent[3]  # no upstream id: the proxy's own
    lines = [(r["request_id"], r["upstream_request_id"]) for r in log_lines.json("request")]
    assert lines == [
        ("my-req-42", "prov-8"),
        (sent[1], "prov-8"),
        (sent[2], "req_011"),
        (sent[3], ""),
    ]


async def test_a_request_outside_any_turn_is_logged_with_no_attempt(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, log_lines: Lines
) -> None:
    # Attempt 0 is "none" (the status page shows "-"): a request that opted out of turns
    # never claimed one; a keyed one is attempt 1 of its turn.
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        keyed = await client.post(CHAT, json=chat_body("k"), headers={"X-Turn-Id": "t"})
        opted_out = await client.post(CHAT, json=chat_body("o"), headers={"X-Turn-Id": "none"})
    assert keyed.headers["x-streamfence-attempt"] == "1"
    assert "x-streamfence-attempt" not in opted_out.headers
    lines = log_lines.json("request")
    assert [(r["turn"] != "", r["attempt"]) for r in lines] == [(True, 1), (False, 0)]


async def test_requests_the_proxy_refuses_are_logged_with_no_upstream_source(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, log_lines: Lines
) -> None:
    token = {"x-streamfence-token": "t0ken"}
    overrides = {"server.access_token": "t0ken", "server.max_body_bytes": 64}
    async with make_proxy(upstream.url, **overrides) as proxy, proxy.client() as client:
        refused = [
            await client.post(CHAT, json=chat_body("no token")),
            await client.get("/_streamfence", headers=token),  # the reserved prefix itself
            await client.post(CHAT, json={}, headers={**token, "X-Turn-Id": ""}),
            await client.post(CHAT, content=b"x" * 100, headers=token),
        ]
        served = await client.post(CHAT, json={"model": "m"}, headers=token)
        metrics = (await client.get("/_streamfence/metrics", headers=token)).text
    assert [r.status_code for r in refused] == [401, 404, 400, 413]
    # Nor are they counted as follows (served from another request's generation).
    assert "\nstreamfence_follows_total{" not in metrics
    assert served.status_code == 200
    assert upstream.seen and len(upstream.seen) == 1
    lines = log_lines.json("request")
    assert [(r["status"], r["source"]) for r in lines] == [
        (401, ""),
        (404, ""),
        (400, ""),
        (413, ""),
        (200, "upstream"),
    ]
    assert all(r["outcome"] == "rejected" for r in lines[:4])


def test_startup_lines_say_where_which_upstreams_and_which_registry() -> None:
    config = load(
        env={},
        overrides={
            "server.port": 9999,
            "upstream.0.url": "https://api.openai.com",
            "upstream.1.url": "https://user:hunter2@gateway.example/v1",
            "upstream.1.name": "gateway",
            "upstream.1.prefix": "/gw",
            "upstream.1.dialect": "anthropic",
            "registry.backend": "redis",
            "registry.url": "redis://:redispass@10.0.0.5:6379/2",
        },
    )
    lines = serve.startup_lines(config)
    text = "\n".join(lines)
    assert lines[0].endswith("listening on http://127.0.0.1:9999")
    assert "upstream 'default': / -> https://api.openai.com (dialect auto)" in text
    assert "upstream 'gateway': /gw -> https://gateway.example/v1 (dialect anthropic)" in text
    assert "registry: redis at 10.0.0.5:6379/2" in text
    assert "hunter2" not in text and "redispass" not in text and "user:" not in text
    assert "WARNING" not in text


def test_startup_warns_about_an_open_port_without_a_token() -> None:
    base = {"upstream.url": "https://api.openai.com", "server.host": "0.0.0.0"}
    open_lines = serve.startup_lines(load(env={}, overrides=base))
    assert open_lines[0].endswith("listening on http://0.0.0.0:8787")
    assert open_lines[-1].startswith("WARNING: listening on 0.0.0.0")
    guarded = serve.startup_lines(load(env={}, overrides={**base, "server.access_token": "t"}))
    assert not any("WARNING" in line for line in guarded)
    assert "registry: memory" in guarded[-1]


RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)")


async def test_in_json_mode_every_line_the_process_writes_is_one_json_object(
    upstream: ScriptedUpstream,
) -> None:
    """The real command, JSON mode (the default): the startup lines, request lines, warnings
    from streamfence (a Redis registry that is down: fail_open), uvicorn's own error log (a
    malformed request) and the shutdown on SIGTERM: each line parses as one JSON object."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "proxy", "--upstream", upstream.url, "--port", "0"],
        *["--registry-url", f"redis://127.0.0.1:{free_port()}/0"],  # nobody listens there
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=clean,
        cwd=ROOT,
    )
    assert proc.stderr is not None and proc.stdout is not None
    try:
        first = await asyncio.wait_for(proc.stderr.readline(), 30)
        url = json.loads(first)["msg"].rsplit(" ", 1)[1]
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            ok = await client.post(CHAT, json=chat_body("ok"), headers={"X-Turn-Id": "t1"})
            assert ok.status_code == 200
            broken = chat_body("broken", fail_after=1)
            async with client.stream("POST", CHAT, json=broken) as r:
                got = await events_of_a_cut_body(r)
            assert got[-1].is_error  # the stream broke after one event, and was cut
            rejected = await client.post(CHAT, json={}, headers={"X-Turn-Id": ""})
            assert rejected.status_code == 400
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")  # uvicorn answers 400 and logs a warning
        assert (await reader.read()).startswith(b"HTTP/1.1 400")
        writer.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    rest = (await proc.stderr.read()).decode()
    assert (await proc.stdout.read()) == b""
    lines = [first.decode(), *rest.splitlines(keepends=True)]
    parsed = []
    for text in lines:
        assert text.endswith("\n")
        obj = json.loads(text)  # one object per line, nothing else
        assert isinstance(obj, dict), text
        assert RFC3339.fullmatch(obj["ts"]), obj
        assert obj["level"] in ("debug", "info", "warning", "error", "critical"), obj
        assert isinstance(obj["logger"], str) and isinstance(obj["msg"], str), obj
        parsed.append(obj)
    loggers = {(p["logger"], p["level"]) for p in parsed}
    assert ("streamfence.startup", "info") in loggers
    assert ("streamfence", "warning") in loggers  # the registry being down
    assert ("uvicorn.error", "warning") in loggers  # the malformed request
    requests = [p for p in parsed if p["msg"] == "request"]
    assert sorted(r["outcome"] for r in requests) == ["completed", "rejected", "upstream_error"]
    for r in requests:  # request lines keep their own fields
        assert {"method", "path", "status", "turn", "attempt", "duration_ms"} <= set(r)


def _first_line_on_a_terminal(*args: str) -> str:
    """The command's first stderr line, its stderr a terminal (a pty)."""
    controller, terminal = pty.openpty()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
    command = [sys.executable, "-m", "proxy", "--upstream", "http://127.0.0.1:9", "--port", "0"]
    with subprocess.Popen([*command, *args], stderr=terminal, env=clean, cwd=ROOT) as proc:
        os.close(terminal)
        try:
            seen = b""
            while b"\n" not in seen:
                ready, _, _ = select.select([controller], [], [], 30)
                assert ready, "no line within 30 s"
                seen += os.read(controller, 4096)
        finally:
            proc.terminate()
            proc.wait(20)
            os.close(controller)
    return seen.split(b"\n", 1)[0].decode().rstrip("\r")


def test_logs_are_text_on_a_terminal_and_json_otherwise() -> None:
    # --log-format auto, the default: a person at a terminal reads text; a pipe (every
    # other test here) gets JSON.
    first = _first_line_on_a_terminal()
    assert first.startswith("streamfence ") and " listening on http://127.0.0.1:" in first
    assert not first.startswith("{")
    asked = json.loads(_first_line_on_a_terminal("--log-format", "json"))
    assert asked["logger"] == "streamfence.startup"


def test_python_warnings_and_uncaught_exceptions_are_json_lines_too() -> None:
    code = (
        "import threading, warnings\n"
        "from proxy.ops import logs\n"
        "logs.configure('info', 'json')\n"
        "warnings.warn('an old API', DeprecationWarning, stacklevel=1)\n"
        "t = threading.Thread(target=lambda: 1 / 0)\n"
        "t.start(); t.join()\n"
        "raise RuntimeError('boom')\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
        check=False,
    )
    assert out.returncode == 1
    lines = [json.loads(line) for line in out.stderr.splitlines()]  # nothing but JSON
    warning, thread, main = lines
    assert (warning["logger"], warning["level"]) == ("py.warnings", "warning")
    assert "an old API" in warning["msg"]
    assert thread["error"] == "ZeroDivisionError: division by zero"
    assert (main["level"], main["error"]) == ("critical", "RuntimeError: boom")
    assert "Traceback" in main["traceback"]


def test_uvicorns_error_line_for_a_refused_upgrade_is_dropped() -> None:
    """A WebSocket upgrade the proxy refuses on purpose (426, the upstream's refusal) is
    not an error: uvicorn's line for it is filtered, its other errors are not."""

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, msg, (), None)

    assert not logs._refused_upgrade(record("ASGI callable returned without completing handshake."))
    assert logs._refused_upgrade(record("Exception in ASGI application"))


def test_lines_left_by_a_loop_that_closed_before_its_flush_go_out_with_the_next(
    sink: tuple[logs.LineSink, _Stream], monkeypatch: pytest.MonkeyPatch
) -> None:
    _alone(sink, monkeypatch)
    line_sink, stream = sink
    closed = asyncio.new_event_loop()
    closed.close()
    # As a loop leaves it that closed with its flush still scheduled:
    line_sink.lines, line_sink._loop, line_sink._scheduled = ["left"], weakref.ref(closed), True

    async def log() -> None:
        logs.log_request(Record("GET", "/next"), "json")

    asyncio.run(log())
    written = stream.getvalue().splitlines()
    assert written[0] == "left" and json.loads(written[1])["path"] == "/next"
