"""Where a process's trace spans go, and how a request's trace crosses process boundaries.

The router and every pool replica call ``setup_tracing`` once with the cluster config's
``tracing`` value:

    none        nothing is recorded (OpenTelemetry's no-op tracer: a span costs next to nothing)
    console     one JSON object per span on the process's stdout (under Ray: its worker log)
    file:PATH   the same, appended to PATH, one line per span (every process may share one file)
    otlp        OTLP over HTTP to ``tracing_endpoint`` (default http://127.0.0.1:4318/v1/traces);
                needs the opentelemetry-exporter-otlp-proto-http package

A trace crosses processes as a W3C ``traceparent`` (and ``tracestate``) carrier: ``inject``
writes the current span's into a dict that rides on the request message, ``extract`` reads one
(an HTTP client's headers, or that dict) back into a parent context. Prompt and output text are
never recorded.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from common.errors import ConfigError

DEFAULT_OTLP_ENDPOINT = "http://127.0.0.1:4318/v1/traces"
_W3C = TraceContextTextMapPropagator()
_lock = threading.Lock()
_configured: str | None = None  # what this process set up (a provider can be set once per process)


def check_tracing(value: str) -> None:
    if value in ("none", "console", "otlp") or (value.startswith("file:") and len(value) > len("file:")):
        return
    raise ConfigError(f"tracing={value!r} is not supported; use none, console, file:PATH or otlp")


def setup_tracing(value: str, service_name: str, endpoint: str | None = None) -> None:
    """Install this process's tracer provider for ``value`` (see the module docstring); once per
    process, later calls with another value are refused (OpenTelemetry allows one provider)."""
    global _configured
    check_tracing(value)
    with _lock:
        if _configured is not None:
            if _configured != value:
                raise ConfigError(f"tracing is already set up as {_configured!r} in this process; not {value!r}")
            return
        if value == "none":
            _configured = value
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if value == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError as exc:
                raise ConfigError(
                    "tracing=otlp needs the OTLP exporter: pip install opentelemetry-exporter-otlp-proto-http"
                ) from exc
            provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or DEFAULT_OTLP_ENDPOINT))
            )
        else:
            # Console and file: written as each span ends (a test or an operator reads them at once).
            provider.add_span_processor(SimpleSpanProcessor(_json_lines_exporter(value)))
        trace.set_tracer_provider(provider)
        _configured = value


def _json_lines_exporter(value: str) -> Any:
    import sys

    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    out = sys.stdout if value == "console" else open(value.removeprefix("file:"), "a", buffering=1)  # noqa: SIM115
    return ConsoleSpanExporter(out=out, formatter=lambda span: json.dumps(json.loads(span.to_json())) + "\n")


def inject(context: Context | None = None) -> dict[str, str]:
    """The W3C carrier of ``context``'s span (the current one by default); empty when not recording."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The parent context a carrier names (HTTP headers or a message's dict); None without one."""
    if not carrier:
        return None
    lowered = {key.lower(): value for key, value in carrier.items() if isinstance(value, str)}
    if "traceparent" not in lowered:
        return None
    return _W3C.extract(lowered)


def enabled() -> bool:
    """Whether this process records spans (building them can be skipped otherwise)."""
    return _configured not in (None, "none")


def monotonic_to_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as epoch nanoseconds (what span start and end times take)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def record_span(
    name: str,
    start_s: float,
    end_s: float,
    parent: Context | None,
    attributes: Mapping[str, Any] | None = None,
    error: str | None = None,
) -> Context:
    """A span of a phase already over, from time.monotonic() readings; returns the context in
    which its children are recorded (a request's phases are known only once they have happened)."""
    span = trace.get_tracer("pdserve").start_span(
        name, context=parent, attributes=dict(attributes or {}), start_time=monotonic_to_ns(start_s)
    )
    if error is not None:
        span.set_status(trace.StatusCode.ERROR, error)
    span.end(end_time=monotonic_to_ns(max(start_s, end_s)))
    return trace.set_span_in_context(span)
