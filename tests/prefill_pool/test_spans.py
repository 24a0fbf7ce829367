"""The pools' trace spans, built from a request's timeline once its phases are over."""

from __future__ import annotations

import time

from common.outputs import CompletionOutput, RequestMetrics, RequestOutput
from common.sampling_params import SamplingParams
from common.serving import PrefillResult, ServeRequest, StreamDelta
from decode_pool.prefill_site import PrefillSite
from decode_pool.server import DecodeTimeline, record_decode_spans
from engine.handoff import SentKV
from engine.handoff.watches import HandoffEnded
from prefill_pool.server import record_prefill_spans

ATTEMPT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"  # the router's attempt span


def request(**fields) -> ServeRequest:
    return ServeRequest(
        "r.0", list(range(40)), SamplingParams(max_tokens=4).to_dict(), trace_context={"traceparent": ATTEMPT}, **fields
    )


def by_name(spans) -> dict:
    return {s.name: s for s in spans}


def test_prefill_spans_cover_queue_each_chunk_and_the_kv_hand_off_under_the_attempt(finished_spans):
    t = time.monotonic() - 1.0
    metrics = RequestMetrics(arrival_time=t, first_scheduled_time=t + 0.1, first_token_time=t + 0.5)
    metrics.prefill_chunks += [(t + 0.1, t + 0.3, 24), (t + 0.3, t + 0.5, 16)]
    output = RequestOutput("r.0", None, list(range(40)), [CompletionOutput(0, "", [7])], True, metrics=metrics)
    # The senders took 0.2 s; the span runs from the last chunk's step to the acknowledgement, 0.25 s.
    ended = HandoffEnded(output, None, SentKV("r.0", None, 0.2, 1 << 20), ended_at=t + 0.55)
    result = PrefillResult("r.0", 7, 0, kv_exposed_s=0.05)
    record_prefill_spans(request(kv_ticket={"backend": "tcp"}), result, ended, t, "p1")
    spans = by_name(finished_spans())
    prefill = spans["pdserve.prefill"]
    assert f"{prefill.parent.span_id:016x}" == "00f067aa0ba902b7" and prefill.attributes["pdserve.replica"] == "p1"
    children = [s for s in finished_spans() if s.parent.span_id == prefill.context.span_id]
    assert sorted(s.name for s in children) == sorted(
        ["pdserve.prefill.queue", "pdserve.prefill.chunk", "pdserve.prefill.chunk", "pdserve.kv_transfer"]
    )
    chunks = sorted((s for s in children if s.name == "pdserve.prefill.chunk"), key=lambda s: s.start_time)
    assert [c.attributes["pdserve.num_tokens"] for c in chunks] == [24, 16]
    transfer = spans["pdserve.kv_transfer"]
    # From the step that computed the prompt's end (the layers leave as computed) to the acknowledgement.
    assert abs(transfer.start_time - chunks[-1].start_time) < 1e6  # ns
    assert abs((transfer.end_time - transfer.start_time) / 1e9 - 0.25) < 0.01
    assert transfer.attributes["pdserve.kv_bytes"] == 1 << 20 and transfer.attributes["pdserve.kv_backend"] == "tcp"
    assert not any("prompt" in key for s in finished_spans() for key in s.attributes)  # never the prompt


def test_a_refused_prefill_is_one_span_with_its_error(finished_spans):
    record_prefill_spans(request(), PrefillResult("r.0", None, 0, "overloaded: full"), None, time.monotonic(), "p1")
    (span,) = finished_spans()
    assert span.name == "pdserve.prefill" and span.status.status_code.name == "ERROR"


def test_decode_spans_split_the_wait_for_blocks_the_wait_for_kv_and_generation(finished_spans):
    t = time.monotonic() - 2.0
    timeline = DecodeTimeline(started=t, ticket_issued=t + 0.2, first_token=t + 0.9, ended=t + 1.5)
    timeline.num_tokens, timeline.finish_reason = 12, "length"
    record_decode_spans(request(), timeline, "d1", colocated=False)
    spans = by_name(finished_spans())
    decode = spans["pdserve.decode"]
    assert decode.attributes["gen_ai.usage.output_tokens"] == 12
    assert decode.attributes["gen_ai.response.finish_reasons"] == ("length",)
    durations = {name: (spans[name].end_time - spans[name].start_time) / 1e9 for name in spans}
    assert abs(durations["pdserve.decode.reserve"] - 0.2) < 0.01
    assert abs(durations["pdserve.decode.kv_wait"] - 0.7) < 0.01
    assert abs(durations["pdserve.decode.generate"] - 0.6) < 0.01
    assert all(spans[n].parent.span_id == decode.context.span_id for n in spans if n != "pdserve.decode")


def test_a_colocated_request_records_its_prompt_s_queue_and_chunks(finished_spans):
    t = time.monotonic() - 2.0
    metrics = RequestMetrics(arrival_time=t, first_scheduled_time=t + 0.05, first_token_time=t + 0.3)
    metrics.prefill_chunks.append((t + 0.05, t + 0.3, 40))
    last = RequestOutput("r.0", None, [], [CompletionOutput(0, "", [1, 2])], True, metrics=metrics)
    timeline = DecodeTimeline(started=t)
    timeline.saw(StreamDelta("r.0", [1], "a"), last)
    timeline.saw(StreamDelta("r.0", [2], "b", finish_reason="length"), last)
    timeline.ended = time.monotonic()
    record_decode_spans(request(), timeline, "c1", colocated=True)
    names = sorted(s.name for s in finished_spans())
    assert names == [
        "pdserve.colocated",
        "pdserve.decode.generate",
        "pdserve.prefill.chunk",
        "pdserve.prefill.queue",
    ]


def test_a_prompt_computed_on_the_decode_replica_records_the_decision_its_reason_and_its_chunks(finished_spans):
    t = time.monotonic() - 2.0
    metrics = RequestMetrics(arrival_time=t, first_scheduled_time=t + 0.01, first_token_time=t + 0.2)
    metrics.prefill_chunks.append((t + 0.01, t + 0.2, 40))
    last = RequestOutput("r.0", None, [], [CompletionOutput(0, "", [1])], True, metrics=metrics)
    timeline = DecodeTimeline(started=t)
    timeline.prefill_site = PrefillSite(True, "local: 0 of 40 prompt tokens cached here", 0.04, 0.3)
    timeline.saw(StreamDelta("r.0", [1], "a", finish_reason="length"), last)
    timeline.ended = time.monotonic()
    record_decode_spans(request(), timeline, "d1", colocated=False)
    spans = by_name(finished_spans())
    decode = spans["pdserve.decode"]
    assert decode.attributes["pdserve.prefill_site"] == "local"
    assert decode.attributes["pdserve.prefill_site.reason"].startswith("local: 0 of 40")
    assert {"pdserve.prefill.queue", "pdserve.prefill.chunk", "pdserve.decode.generate"} <= set(spans)
    assert "pdserve.decode.kv_wait" not in spans  # no KV was waited for


def test_a_remote_decision_is_recorded_beside_the_wait_for_kv(finished_spans):
    t = time.monotonic() - 2.0
    timeline = DecodeTimeline(started=t, ticket_issued=t + 0.1, first_token=t + 0.5, ended=t + 1.0)
    timeline.prefill_site = PrefillSite(False, "remote: would stall 3 running requests", 0.5, 0.4)
    record_decode_spans(request(), timeline, "d1", colocated=False)
    spans = by_name(finished_spans())
    assert spans["pdserve.decode"].attributes["pdserve.prefill_site"] == "remote"
    assert "pdserve.prefill.chunk" not in spans and "pdserve.decode.kv_wait" in spans
