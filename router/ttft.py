"""Where a request's time to first token went, as the router measured it.

    router gets the request ─▶ … ─▶ the prompt's replica: queue ─▶ prefill ─▶ KV hand-off ─▶ … ─▶ first token out
                                                           queue_s   prefill_s  kv_transfer_exposed_s
    other_s = TTFT − the parts known: the router (parsing, tokenizing, placement), the hops, the decode
              replica's reservation and first emission

The parts come from the attempt that produced the first token: prefill's reply (disaggregated), or
that attempt's finished delta (colocated, or a prompt its decode replica computed itself). Pure
functions over the pools' messages; the orchestrator builds the breakdown once, on the last delta.
"""

from __future__ import annotations

import dataclasses

from common.serving import PrefillResult, StreamDelta, TTFTBreakdown

_SPAN_PREFIX = "pdserve.ttft."


def ttft_breakdown(ttft_s: float, prefilled: PrefillResult | None, finished: StreamDelta | None) -> TTFTBreakdown:
    """The breakdown of ``ttft_s`` (the router's arrival to the first token it passed on).

    ``prefilled``: the reply of the prefill replica that ran the first-token attempt's prompt; None
    when the prompt ran on the decode replica (colocated, or conditional disaggregation chose it) or
    the reply was lost. ``finished``: that attempt's finished delta, None when that attempt did not
    finish the request (its stream was lost and resumed elsewhere: its facts died with it); its queue
    and prefill times count only without a prefill reply (otherwise the prompt did not run there).
    """
    if prefilled is not None:
        queue_s, prefill_s, exposed_s = prefilled.queue_time_s, prefilled.prefill_time_s, prefilled.kv_exposed_s
    elif finished is not None:
        queue_s, prefill_s, exposed_s = finished.queue_time_s, finished.prefill_time_s, None
    else:
        queue_s = prefill_s = exposed_s = None
    known = sum(part for part in (queue_s, prefill_s, exposed_s) if part is not None)
    # Floored: the parts come from other processes' clocks, and a reply can round past the router's TTFT.
    return TTFTBreakdown(queue_s, prefill_s, exposed_s, max(0.0, ttft_s - known))


def ttft_span_attributes(breakdown: TTFTBreakdown) -> dict[str, float]:
    """``pdserve.ttft.<part>`` for the request's span, the parts known only."""
    return {_SPAN_PREFIX + name: value for name, value in dataclasses.asdict(breakdown).items() if value is not None}
