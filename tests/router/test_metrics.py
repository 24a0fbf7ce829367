"""The router's Prometheus metrics: what a scrape of /metrics reads, parsed by prometheus_client's
own parser (the format is the library's; these tests check names, labels and values)."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from common.serving import PrefillResult, TTFTBreakdown
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from tests.router.test_orchestrator import GREEDY, FakeDecode, FakePrefill, _actor_died, run, tokens


def scrape(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape: (sample name, sorted labels) -> value."""
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


MODEL = (("model_name", "smol"),)


def test_a_streamed_request_is_counted_once_with_its_latencies_tokens_and_finish_reason():
    metrics = RouterMetrics("colocated", "smol")
    started = time.monotonic() - 0.5
    metrics.request_started()
    assert scrape(metrics)[("pdserve:router_requests_in_flight", MODEL)] == 1
    metrics.first_token(0.2)
    metrics.tokens_arrived(3, 0.3)  # three tokens in one delta (stream_interval 3), 0.3 s after the first
    metrics.phases(0.01, 0.15)
    metrics.request_ended("ok", started, time.monotonic() - 0.3, 4, num_prompt_tokens=7, finish_reason="length")
    samples = scrape(metrics)
    assert samples[("pdserve:time_to_first_token_seconds_count", MODEL)] == 1
    assert samples[("pdserve:time_to_first_token_seconds_sum", MODEL)] == 0.2
    assert samples[("pdserve:inter_token_latency_seconds_count", MODEL)] == 3
    assert abs(samples[("pdserve:inter_token_latency_seconds_sum", MODEL)] - 0.3) < 1e-9
    # 0.1 s each: under the 0.1 bucket's bound, not under 0.075's
    assert samples[("pdserve:inter_token_latency_seconds_bucket", (("le", "0.1"), *MODEL))] == 3
    assert samples[("pdserve:inter_token_latency_seconds_bucket", (("le", "0.075"), *MODEL))] == 0
    assert samples[("pdserve:request_queue_time_seconds_sum", MODEL)] == 0.01
    assert samples[("pdserve:request_prefill_time_seconds_sum", MODEL)] == 0.15
    assert samples[("pdserve:e2e_request_latency_seconds_count", MODEL)] == 1
    assert samples[("pdserve:e2e_request_latency_seconds_sum", MODEL)] >= 0.5
    assert samples[("pdserve:request_decode_time_seconds_sum", MODEL)] >= 0.3
    assert samples[("pdserve:request_success_total", (("finished_reason", "length"), *MODEL))] == 1
    assert samples[("pdserve:prompt_tokens_total", MODEL)] == 7
    assert samples[("pdserve:generation_tokens_total", MODEL)] == 4
    assert samples[("pdserve:router_requests_in_flight", MODEL)] == 0


def test_refusals_and_failures_count_as_failures_by_reason_not_as_latencies():
    metrics = RouterMetrics("disagg", "smol")
    metrics.request_failed(400)
    for outcome in ("error", "cancelled", None):  # None: refused, counted by request_failed
        metrics.request_started()
        metrics.request_ended(outcome, time.monotonic(), None, 0, num_prompt_tokens=5)
    metrics.request_failed(503)
    samples = scrape(metrics)
    for reason in ("http_400", "http_503", "error", "cancelled"):
        assert samples[("pdserve:request_failure_total", (*MODEL, ("reason", reason)))] == 1
    assert ("pdserve:e2e_request_latency_seconds_count", MODEL) not in samples or (
        samples[("pdserve:e2e_request_latency_seconds_count", MODEL)] == 0
    )
    assert samples[("pdserve:prompt_tokens_total", MODEL)] == 10  # error and cancelled ran on the pools
    assert samples[("pdserve:router_requests_in_flight", MODEL)] == 0
    assert metrics.snapshot()["outcomes"] == {"http_400": 1, "http_503": 1, "error": 1, "cancelled": 1}


def test_a_refusal_for_a_field_not_honoured_counts_that_field_and_only_a_known_one():
    metrics = RouterMetrics("disagg", "smol")
    metrics.request_failed(400, refused_field="guided_json")
    metrics.request_failed(400, refused_field="guided_json")
    metrics.request_failed(400, refused_field="x" * 64)  # not a field any client defines: no label made
    samples = scrape(metrics)
    assert samples[("pdserve:request_refused_field_total", (("field", "guided_json"), *MODEL))] == 2
    assert not [
        key for key in samples if key[0] == "pdserve:request_refused_field_total" and ("field", "x" * 64) in key[1]
    ]
    assert samples[("pdserve:request_failure_total", (*MODEL, ("reason", "http_400")))] == 3


def test_prefill_s_reply_feeds_the_kv_transfer_and_phase_histograms():
    metrics = RouterMetrics("disagg", "smol")
    reply = PrefillResult("r.0", 42, 0, queue_time_s=0.02, prefill_time_s=0.4, kv_bytes=3 << 20)
    metrics.prefill_reply(reply)
    metrics.prefill_reply(PrefillResult("r.1", 42, 0, kv_bytes=1 << 20, kv_transfer_s=0.05, kv_exposed_s=0.004))
    samples = scrape(metrics)
    assert samples[("pdserve:kv_transfer_bytes_count", MODEL)] == 2
    assert samples[("pdserve:kv_transfer_bytes_sum", MODEL)] == 4 << 20
    assert samples[("pdserve:kv_transfer_seconds_count", MODEL)] == 1
    assert samples[("pdserve:kv_transfer_exposed_seconds_sum", MODEL)] == 0.004
    assert samples[("pdserve:request_queue_time_seconds_count", MODEL)] == 1
    assert samples[("pdserve:request_prefill_time_seconds_sum", MODEL)] == 0.4


def test_replica_reports_become_gauges_and_counters_labelled_by_pool_and_replica():
    reports = {
        "decode": [
            {
                "replica_id": "d1",
                "num_running": 3,
                "num_waiting": 1,
                "num_reserved": 2,
                "num_waiting_for_blocks": 4,
                "num_kv_blocks_total": 100,
                "num_kv_blocks_free": 25,
                "prefix_cache_queried_tokens": 640,
                "prefix_cache_hit_tokens": 320,
                "num_kv_lease_expirations": 1,
                "num_steps": 50,
                "num_steps_ahead": 48,
            }
        ],
        "prefill": [{"replica_id": "p1", "num_waiting": 5, "num_handoff": 3, "num_preemptions": 2}],
    }
    metrics = RouterMetrics("disagg", "smol", reports=lambda: reports)
    samples = scrape(metrics)

    def at(name: str, pool: str, replica: str) -> float:
        return samples[(name, (("pool", pool), ("replica", replica)))]

    assert at("pdserve:num_requests_running", "decode", "d1") == 3
    assert at("pdserve:num_requests_waiting", "prefill", "p1") == 5
    assert at("pdserve:kv_cache_usage_perc", "decode", "d1") == 0.75
    assert at("pdserve:kv_cache_usage_perc", "prefill", "p1") == 0  # no blocks reported: not 100% used
    assert at("pdserve:kv_tickets_outstanding", "decode", "d1") == 2
    assert at("pdserve:kv_tickets_outstanding", "prefill", "p1") == 3
    assert at("pdserve:kv_reservation_queue_length", "decode", "d1") == 4
    assert at("pdserve:prefix_cache_queries_total", "decode", "d1") == 640
    assert at("pdserve:prefix_cache_hits_total", "decode", "d1") == 320
    assert at("pdserve:kv_lease_expirations_total", "decode", "d1") == 1
    assert at("pdserve:num_preemptions_total", "prefill", "p1") == 2
    assert at("pdserve:engine_steps_total", "decode", "d1") == 50
    assert at("pdserve:engine_steps_ahead_total", "decode", "d1") == 48
    # Read at scrape time: a fresh report shows at the next scrape.
    reports["decode"][0]["num_running"] = 0
    assert scrape(metrics)[("pdserve:num_requests_running", (("pool", "decode"), ("replica", "d1")))] == 0


def test_two_routers_in_one_process_keep_their_own_registries():
    first, second = RouterMetrics("disagg", "smol"), RouterMetrics("disagg", "smol")
    first.first_token(0.1)
    assert scrape(first)[("pdserve:time_to_first_token_seconds_count", MODEL)] == 1
    assert scrape(second)[("pdserve:time_to_first_token_seconds_count", MODEL)] == 0


def test_the_orchestrator_reports_prefill_replies_retries_and_migrations():
    metrics = RouterMetrics("disagg", "smol")
    decode, prefill = FakeDecode([{}, {}]), FakePrefill([_actor_died()])
    deltas = run(Orchestrator(decode, prefill, max_retries=1, observer=metrics), GREEDY)  # retried once
    assert deltas[-1].finish_reason == "length"
    reply = PrefillResult("req.0", 1, 0, kv_bytes=1 << 20, kv_exposed_s=0.002)
    assert run(Orchestrator(FakeDecode([{}]), FakePrefill([reply]), observer=metrics), GREEDY)[-1].finish_reason
    resumed = Orchestrator(FakeDecode([{"die_after": 3}, {}]), FakePrefill([]), observer=metrics)
    assert len(tokens(run(resumed, GREEDY))) == 8  # migrated once
    samples = scrape(metrics)
    assert samples[("pdserve:request_retries_total", MODEL)] == 1
    assert samples[("pdserve:request_migrations_total", MODEL)] == 1
    assert samples[("pdserve:kv_transfer_bytes_sum", MODEL)] == 1 << 20
    assert samples[("pdserve:kv_transfer_exposed_seconds_sum", MODEL)] == 0.002


def test_the_part_of_ttft_no_phase_explains_is_one_sample_per_breakdown_in_ttfts_buckets():
    metrics = RouterMetrics("disagg", "smol")
    metrics.ttft_breakdown(TTFTBreakdown(0.2, 0.5, 0.1, other_s=0.03))
    metrics.ttft_breakdown(TTFTBreakdown(None, None, None, other_s=0.9))
    samples = scrape(metrics)
    name = "pdserve:time_to_first_token_other_seconds"
    assert samples[(f"{name}_count", MODEL)] == 2
    assert abs(samples[(f"{name}_sum", MODEL)] - 0.93) < 1e-9
    assert samples[(f"{name}_bucket", (("le", "0.04"), *MODEL))] == 1  # TTFT's buckets: 0.03 under 0.04
    assert samples[(f"{name}_bucket", (("le", "1.0"), *MODEL))] == 2
    # The phases stay in their own series: a breakdown adds no queue or prefill sample.
    assert samples[("pdserve:request_queue_time_seconds_count", MODEL)] == 0
    body = metrics.exposition()[0].decode()
    assert f"# HELP {name} A request's time to first token less its queue" in body
