"""Tracing set-up, W3C propagation, and spans of phases recorded after the fact."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from common import tracing
from common.errors import ConfigError


@pytest.mark.parametrize("value", ["", "jaeger", "file:", "File:/tmp/x"])
def test_unknown_tracing_values_are_refused(value):
    with pytest.raises(ConfigError, match="none, console, file:PATH or otlp"):
        tracing.check_tracing(value)


def test_extract_reads_a_traceparent_in_any_case_and_nothing_else():
    assert tracing.extract(None) is None and tracing.extract({"x-request-id": "a"}) is None
    context = tracing.extract({"TraceParent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    from opentelemetry import trace

    span_context = trace.get_current_span(context).get_span_context()
    assert span_context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736 and span_context.is_remote


def test_a_span_recorded_after_the_fact_has_its_times_and_parent(finished_spans):
    parent = tracing.extract({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    now = time.monotonic()
    child_context = tracing.record_span("phase", now - 0.5, now - 0.2, parent, {"pdserve.num_tokens": 7})
    tracing.record_span("inner", now - 0.4, now - 0.3, child_context, error="boom")
    spans = {s.name: s for s in finished_spans()}
    phase, inner = spans["phase"], spans["inner"]
    assert abs((phase.end_time - phase.start_time) / 1e9 - 0.3) < 0.01
    assert abs(time.time() - 0.5 - phase.start_time / 1e9) < 0.05
    assert phase.parent.span_id == 0x00F067AA0BA902B7 and inner.parent.span_id == phase.context.span_id
    assert phase.attributes["pdserve.num_tokens"] == 7 and inner.status.status_code.name == "ERROR"


def test_file_tracing_writes_one_json_line_per_span_and_is_set_up_once_per_process(tmp_path):
    # In a child process: a tracer provider, once set, stays for the process.
    path = tmp_path / "spans.jsonl"
    script = f"""
from common import tracing
from common.errors import ConfigError
tracing.setup_tracing("file:{path}", "pdserve-test")
tracing.setup_tracing("file:{path}", "pdserve-test")  # the same again: nothing to do
try:
    tracing.setup_tracing("console", "pdserve-test")
except ConfigError as exc:
    print("refused:", exc)
assert tracing.enabled()
carrier = tracing.inject(tracing.record_span("one", 1.0, 2.0, None))
tracing.record_span("two", 1.5, 1.8, tracing.extract(carrier))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "refused: tracing is already set up as 'file:" in done.stdout
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["name"] for s in spans] == ["one", "two"]
    assert spans[1]["parent_id"] == spans[0]["context"]["span_id"]
    assert spans[0]["resource"]["attributes"]["service.name"] == "pdserve-test"


def test_otlp_tracing_posts_the_spans_to_the_configured_endpoint(tmp_path):
    """tracing=otlp: a child process's spans reach an OTLP/HTTP receiver (here a local one that
    decodes the protobuf export request, as a collector would)."""
    import http.server
    import threading

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[tuple[str, str, bytes]] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append((self.path, self.headers["content-type"], body))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    script = f"""
from opentelemetry import trace
from common import tracing
tracing.setup_tracing("otlp", "pdserve-test", {endpoint!r})
parent = tracing.record_span("pdserve.request", 1.0, 2.0, None, {{"gen_ai.usage.input_tokens": 3}})
tracing.record_span("pdserve.attempt", 1.1, 1.9, parent)
assert trace.get_tracer_provider().force_flush(10_000)
"""
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    finally:
        server.shutdown()
    spans, services = {}, set()
    for path, content_type, body in received:
        assert path == "/v1/traces" and content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            services |= {a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"}
            for scope in resource_spans.scope_spans:
                spans.update({span.name: span for span in scope.spans})
    assert services == {"pdserve-test"} and set(spans) == {"pdserve.request", "pdserve.attempt"}
    assert spans["pdserve.attempt"].parent_span_id == spans["pdserve.request"].span_id
    assert spans["pdserve.attempt"].trace_id == spans["pdserve.request"].trace_id
