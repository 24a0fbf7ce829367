"""router.ttft: a request's TTFT split into the replica's queue, prefill, exposed KV transfer and the rest."""

from __future__ import annotations

import pytest

from common.serving import PrefillResult, StreamDelta, TTFTBreakdown
from router.ttft import ttft_breakdown, ttft_span_attributes


def finished(queue_time_s: float | None = None, prefill_time_s: float | None = None) -> StreamDelta:
    return StreamDelta("r.0", [7], "x", finish_reason="stop", queue_time_s=queue_time_s, prefill_time_s=prefill_time_s)


def reply(queue: float | None, prefill: float | None, exposed: float | None) -> PrefillResult:
    return PrefillResult("r.0", 7, 0, queue_time_s=queue, prefill_time_s=prefill, kv_exposed_s=exposed)


def test_disaggregated_parts_come_from_prefills_reply_and_other_is_the_rest():
    breakdown = ttft_breakdown(1.0, reply(0.2, 0.5, 0.1), finished())
    assert breakdown.queue_s == 0.2 and breakdown.prefill_s == 0.5 and breakdown.kv_transfer_exposed_s == 0.1
    assert breakdown.other_s == pytest.approx(0.2)


def test_with_prefills_reply_the_decode_replicas_own_times_do_not_count():
    # The prompt ran on the prefill replica; whatever the decode side reports is not its prompt's.
    breakdown = ttft_breakdown(1.0, reply(0.2, 0.5, None), finished(queue_time_s=0.3, prefill_time_s=0.05))
    assert (breakdown.queue_s, breakdown.prefill_s, breakdown.kv_transfer_exposed_s) == (0.2, 0.5, None)
    assert breakdown.other_s == pytest.approx(0.3)


def test_colocated_or_prefilled_on_the_decode_replica_parts_come_from_the_finished_delta():
    breakdown = ttft_breakdown(0.5, None, finished(queue_time_s=0.1, prefill_time_s=0.3))
    assert breakdown == TTFTBreakdown(0.1, 0.3, None, pytest.approx(0.1))


def test_missing_facts_leave_their_parts_null_and_other_takes_the_whole_ttft():
    # prefill's reply lost (disaggregated: decode reports no times), or a stream resumed elsewhere.
    assert ttft_breakdown(0.8, None, finished()) == TTFTBreakdown(None, None, None, 0.8)
    assert ttft_breakdown(0.8, None, None) == TTFTBreakdown(None, None, None, 0.8)
    # A reply without a queue time (the engine's metrics missing) still brings what it has.
    partial = ttft_breakdown(0.8, reply(None, 0.5, 0.1), finished())
    assert (partial.queue_s, partial.prefill_s) == (None, 0.5) and partial.other_s == pytest.approx(0.2)


def test_other_is_floored_at_zero_when_the_replicas_clocks_add_up_past_the_ttft():
    assert ttft_breakdown(0.5, reply(0.2, 0.3, 0.05), finished()).other_s == 0.0


def test_span_attributes_name_the_known_parts_only():
    assert ttft_span_attributes(TTFTBreakdown(0.1, 0.3, None, 0.05)) == {
        "pdserve.ttft.queue_s": 0.1,
        "pdserve.ttft.prefill_s": 0.3,
        "pdserve.ttft.other_s": 0.05,
    }
    assert ttft_span_attributes(TTFTBreakdown(None, None, None, 0.8)) == {"pdserve.ttft.other_s": 0.8}
