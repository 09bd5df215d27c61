"""OpenTelemetry traces, received for real: a small OTLP/HTTP collector on 127.0.0.1 decodes
each ExportTraceServiceRequest (protobuf, opentelemetry-proto) the proxy's exporter posts,
and the spans are checked against the traffic that made them: parent = the caller's
traceparent, the upstream saw the proxy span's own traceparent, GenAI and streamfence
attributes, a supersede's outcome and fence latency. Off by default, and then opentelemetry
is not even imported."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import AsyncExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from proxy.config.schema import TracingConfig
from proxy.ops import tracing
from tests.conftest import ProxyFactory
from tests.scripted import ScriptedUpstream, free_port
from tests.sse_client import chat_body, events, open_stream

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP receiver: POST /v1/traces with application/x-protobuf."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.resources: list[dict[str, Any]] = []
        self.content_types: list[str] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["content-length"]))
                collector.receive(self.path, self.headers.get("content-type", ""), body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def receive(self, path: str, content_type: str, body: bytes) -> None:
        assert path == "/v1/traces"
        self.content_types.append(content_type)
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            self.resources.append(_attrs(resource_spans.resource.attributes))
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        {
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "kind": span.kind,
                            "status": span.status.code,
                            "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano,
                            "attrs": _attrs(span.attributes),
                        }
                    )


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    c.thread.start()
    yield c
    c.server.shutdown()
    c.server.server_close()


async def test_one_span_per_request_child_of_the_caller_and_parent_of_the_upstream(
    upstream: ScriptedUpstream, make_proxy: ProxyFactory, collector: Collector
) -> None:
    caller = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
    options = {"tracing.enabled": "on", "tracing.endpoint": collector.url}
    async with make_proxy(upstream.url, **options) as proxy, proxy.client() as client:
        traced = await client.post(
            CHAT,
            json=chat_body("traced", usage={"input": 12, "output": 5}, model="m-2026-01"),
            headers={"traceparent": caller, "tracestate": "vendor=1", "X-Turn-Id": "t-1"},
        )
        assert traced.status_code == 200
        gemini = await client.post(
            "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
            json={"contents": [{"parts": [{"text": "hi"}]}]},
        )
        assert gemini.status_code == 200
        async with AsyncExitStack() as stack:  # a supersede: two attempts of one turn
            a = await open_stream(
                stack, client, CHAT, chat_body("s", gated=True), {"X-Turn-Id": "k"}
            )
            a_events = events(a)
            await anext(a_events)
            b = await client.post(CHAT, json=chat_body("s"), headers={"X-Turn-Id": "k"})
            assert b.status_code == 200
            assert [e async for e in a_events][-1].json["error"]["code"] == "stream_superseded"
        await proxy.runtime.wait_idle()
    # The lifespan's end flushed the batch processor: everything has been exported.
    assert set(collector.content_types) == {"application/x-protobuf"}
    assert collector.resources[0]["service.name"] == "streamfence"
    assert len(collector.spans) == 4  # one per proxied request
    first = next(s for s in collector.spans if s["trace_id"] == TRACE_ID)
    assert first["parent"] == CALLER_SPAN  # a child of the caller's span
    assert first["kind"] == 2  # SPAN_KIND_SERVER
    assert first["end"] > first["start"]
    # The upstream got the proxy span's context, not the caller's.
    sent = upstream.seen[0].headers
    assert sent["traceparent"] == f"00-{TRACE_ID}-{first['span_id']}-01"
    assert sent["tracestate"] == "vendor=1"
    attrs = first["attrs"]
    assert attrs["gen_ai.system"] == "openai" and attrs["gen_ai.operation.name"] == "chat"
    # The model asked for and the one that answered, and what the answer reported it cost.
    assert (attrs["gen_ai.request.model"], attrs["gen_ai.response.model"]) == ("m", "m-2026-01")
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (12, 5)
    assert attrs["streamfence.turn"] == traced.headers["x-streamfence-turn"]
    assert attrs["streamfence.attempt"] == 1 and attrs["streamfence.outcome"] == "completed"
    assert attrs["streamfence.events"] == 6 and attrs["http.response.status_code"] == 200  # +usage
    assert attrs["http.request.method"] == "POST" and attrs["url.path"] == CHAT
    for secret in ("t-1", "traced"):  # neither the raw turn id nor the body
        assert all(secret != v for s in collector.spans for v in s["attrs"].values())

    g = next(s for s in collector.spans if s["attrs"].get("gen_ai.system") == "gcp.gemini")
    assert g["attrs"]["gen_ai.request.model"] == "gemini-2.5-flash"
    assert g["name"] == "generate_content gemini-2.5-flash"
    assert g["parent"] == ""  # no traceparent from the caller: a root span
    assert upstream.seen[1].headers["traceparent"].split("-")[1] == g["trace_id"]

    fenced = next(s for s in collector.spans if s["attrs"]["streamfence.outcome"] == "superseded")
    assert fenced["attrs"]["streamfence.superseded_by"] == 2
    assert 0 <= fenced["attrs"]["streamfence.fence_latency_ms"] < 50
    assert fenced["attrs"]["streamfence.error"] == "stream_superseded"


async def test_the_standard_otel_variables_turn_it_on(
    upstream: ScriptedUpstream,
    make_proxy: ProxyFactory,
    collector: Collector,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", collector.url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "agents-gateway")
    async with make_proxy(upstream.url) as proxy, proxy.client() as client:
        assert proxy.runtime.tracer is not None
        assert (await client.get("/v1/models")).status_code == 200
        await proxy.runtime.wait_idle()
    (span,) = collector.spans
    assert span["name"] == "GET" and span["attrs"]["url.path"] == "/v1/models"
    assert collector.resources[0]["service.name"] == "agents-gateway"


def test_when_tracing_is_on_and_when_not() -> None:
    auto, on, off = (TracingConfig(enabled=e) for e in ("auto", "on", "off"))
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert tracing.wanted(auto, {}) is None
    assert tracing.wanted(auto, endpoint) == "OTEL_EXPORTER_OTLP_ENDPOINT"
    assert tracing.wanted(auto, {"OTEL_TRACES_EXPORTER": "otlp"}) == "OTEL_TRACES_EXPORTER"
    assert tracing.wanted(auto, {**endpoint, "OTEL_SDK_DISABLED": "true"}) is None
    assert tracing.wanted(auto, {**endpoint, "OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracing.wanted(off, endpoint) is None
    assert tracing.wanted(on, {}) == "[tracing] enabled"


def test_off_it_never_imports_opentelemetry() -> None:
    code = (
        "import sys\n"
        "from proxy.server.app import create_app\n"
        "from proxy.config.load import load\n"
        "app = create_app(load(env={}, overrides={'upstream.url': 'http://127.0.0.1:9'}))\n"
        "assert app.state.runtime.tracer is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {"PATH": "/usr/bin:/bin"}  # no OTEL_* variables
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_on_without_the_sdk_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # As if the [otel] extra were not installed: the import fails.
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(tracing.TracingUnavailable) as caught:
        tracing.check(TracingConfig(), {"OTEL_TRACES_EXPORTER": "otlp"})
    assert "pip install 'streamfence[otel]'" in str(caught.value)
    assert "OTEL_TRACES_EXPORTER" in str(caught.value)


async def test_an_upstream_failure_is_an_error_span(
    make_proxy: ProxyFactory, collector: Collector
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    options = {"tracing.enabled": "on", "tracing.endpoint": collector.url}
    async with make_proxy(dead, **options) as proxy, proxy.client() as client:
        assert (await client.post(CHAT, json=chat_body("x"))).status_code == 502
        await proxy.runtime.wait_idle()
    (span,) = collector.spans
    assert span["status"] == 2  # STATUS_CODE_ERROR
    assert span["attrs"]["streamfence.outcome"] == "upstream_error"
    assert span["attrs"]["streamfence.error"] == "upstream_unreachable"
    assert span["attrs"]["http.response.status_code"] == 502
