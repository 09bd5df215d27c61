"""OpenTelemetry traces: one span per proxied request (the `streamfence[otel]` extra).

Off unless `[tracing] enabled = "on"`, or "auto" (the default) and the standard variables
ask for traces: OTEL_TRACES_EXPORTER=otlp, OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none
turn "auto" off). Off, `create` returns None and opentelemetry is never imported: the app
pays one `is None` per request.

On, the proxy's span is a child of the caller's W3C `traceparent`, and the upstream request
carries the proxy span's own `traceparent` (the caller's `tracestate` is kept). The span has
the GenAI semantic-convention attributes that the proxy knows without parsing a body again
(gen_ai.system / gen_ai.provider.name and gen_ai.operation.name from the dialect;
gen_ai.request.model where the path names it, as Gemini's does) and streamfence's own: the
hashed turn, attempt, outcome, error, events, dropped events, fence latency. Spans go out
through the SDK's batch processor (its own thread) to an OTLP/HTTP endpoint; the sampler,
resource and exporter settings are the SDK's OTEL_* variables.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from proxy.config.schema import TracingConfig, TracingMode
from proxy.ops.record import Outcome, Record

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

INSTALL_HINT = "pip install 'streamfence[otel]'"
TRACE_HEADERS = (b"traceparent", b"tracestate")
# dialect -> (gen_ai.system, gen_ai.operation.name)
GEN_AI = {
    "openai-chat": ("openai", "chat"),
    "openai-responses": ("openai", "chat"),
    "anthropic": ("anthropic", "chat"),
    "gemini": ("gcp.gemini", "generate_content"),
}
_PATH_MODEL = re.compile(r"/models/([^/:]{1,200})")


class TracingUnavailable(Exception):
    """Tracing is asked for but the OpenTelemetry SDK is not installed."""


def wanted(config: TracingConfig, env: Mapping[str, str]) -> str | None:
    """Why tracing is on ("[tracing] enabled", or the variable that asked), or None: off."""
    if config.enabled != TracingMode.AUTO:
        return "[tracing] enabled" if config.enabled == TracingMode.ON else None
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporters = {e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "").lower().split(",")}
    if "none" in exporters:
        return None
    if "otlp" in exporters:
        return "OTEL_TRACES_EXPORTER"
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        if env.get(name):
            return name
    return "[tracing] endpoint" if config.endpoint else None


def check(config: TracingConfig, env: Mapping[str, str] | None = None) -> None:
    """Raise TracingUnavailable, with what to do, if tracing is on but cannot run."""
    why = wanted(config, os.environ if env is None else env)
    if why is None:
        return
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401, PLC0415
        import opentelemetry.sdk.trace  # noqa: F401, PLC0415
    except ImportError:
        raise TracingUnavailable(
            f"tracing is on ({why}) but OpenTelemetry is not installed: {INSTALL_HINT}, "
            'or set [tracing] enabled = "off"'
        ) from None


def create(config: TracingConfig, env: Mapping[str, str] | None = None) -> Tracer | None:
    env = os.environ if env is None else env
    if wanted(config, env) is None:
        return None
    check(config, env)
    return Tracer(config, env)


class Tracer:
    def __init__(self, config: TracingConfig, env: Mapping[str, str]) -> None:
        # Imported here, and only here: with tracing off none of this is ever loaded.
        from opentelemetry import trace  # noqa: PLC0415
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
        from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415
            TraceContextTextMapPropagator,
        )

        from proxy import __version__  # noqa: PLC0415

        attributes: dict[str, Any] = {"service.version": __version__}
        if not env.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = "streamfence"
        self.provider: TracerProvider = TracerProvider(resource=Resource.create(attributes))
        exporter = OTLPSpanExporter(endpoint=config.endpoint or None)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("streamfence", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.trace = trace

    def start(
        self,
        record: Record,
        incoming: list[tuple[bytes, bytes]],
        outgoing: list[tuple[bytes, bytes]],
    ) -> list[tuple[bytes, bytes]]:
        """Open the request's span; returns the upstream headers with its traceparent."""
        carrier = {
            n.decode("latin-1"): v.decode("latin-1") for n, v in incoming if n in TRACE_HEADERS
        }
        parent = self.propagator.extract(carrier)
        system, operation = GEN_AI.get(record.dialect, (None, None))
        model = _PATH_MODEL.search(record.path)
        attributes: dict[str, Any] = {
            "http.request.method": record.method,
            "url.path": record.path,
            "streamfence.upstream": record.upstream,
            "streamfence.dialect": record.dialect,
        }
        if system is not None:
            attributes["gen_ai.system"] = attributes["gen_ai.provider.name"] = system
            attributes["gen_ai.operation.name"] = operation
        requested = record.model or (model.group(1) if model is not None else "")
        if requested:  # the body's model (proxy/wire/usage.py), else the path's (Gemini)
            attributes["gen_ai.request.model"] = requested
        name = " ".join(x for x in (operation or record.method, requested) if x)
        # The record's clock is perf_counter; a span wants the wall clock in nanoseconds.
        started = time.time_ns() - int((time.perf_counter() - record.started) * 1e9)
        span = self.tracer.start_span(
            name,
            context=parent,
            kind=self.trace.SpanKind.SERVER,
            attributes=attributes,
            start_time=started,
        )
        record.trace = span
        out: dict[str, str] = {}
        self.propagator.inject(out, context=self.trace.set_span_in_context(span))
        headers = [(n, v) for n, v in outgoing if n not in TRACE_HEADERS]
        # The span context carries the caller's tracestate on: inject writes it back.
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out.items()]
        return headers

    def end(self, record: Record) -> None:
        span = record.trace
        if span is None:
            return  # rejected before it was forwarded: no span was opened
        record.trace = None
        attributes: dict[str, Any] = {
            "streamfence.outcome": record.outcome,
            "streamfence.attempt": record.attempt,
            "streamfence.source": record.source,
            "streamfence.events": record.events,
            "streamfence.dropped": record.dropped,
            "streamfence.streaming": record.streaming,
        }
        if record.turn:
            attributes["streamfence.turn"] = record.turn
        if record.status:
            attributes["http.response.status_code"] = record.status
        if record.error:
            attributes["streamfence.error"] = record.error
        if record.fence_latency is not None:
            attributes["streamfence.fence_latency_ms"] = round(record.fence_latency * 1000, 3)
        if record.superseded_by is not None:
            attributes["streamfence.superseded_by"] = record.superseded_by
        usage = record.usage
        if usage is not None:  # OpenTelemetry's GenAI conventions, as the provider reported
            if usage.model:
                attributes["gen_ai.response.model"] = usage.model
            if usage.input is not None:
                attributes["gen_ai.usage.input_tokens"] = usage.input
            if usage.output is not None:
                attributes["gen_ai.usage.output_tokens"] = usage.output
        span.set_attributes(attributes)
        if record.outcome in (Outcome.UPSTREAM_ERROR, Outcome.SHUTDOWN):
            span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, record.error))
        span.end()

    def shutdown(self) -> None:
        """Export what is still queued (from the lifespan's end)."""
        self.provider.shutdown()
