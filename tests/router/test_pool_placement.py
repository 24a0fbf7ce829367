"""One pool's placement as the router runs it: load view, prefix index and policy together."""

from __future__ import annotations

import time

from common.block_hash import hash_full_blocks, pack_short_hashes, short_hashes
from common.sampling_params import SamplingParams
from common.serving import ReplicaReport, ServeRequest
from router.pool_placement import PoolPlacement, estimated_queued_tokens

SYSTEM = list(range(1000, 1256))  # 16 blocks every conversation shares


def prefill(replica_id: str, **fields) -> ReplicaReport:
    defaults = {"num_kv_blocks_free": 1000, "num_kv_blocks_total": 1000, "max_model_len": 4096}
    return ReplicaReport(replica_id=replica_id, role="prefill", **{**defaults, **fields})


def serve_request(request_id: str, tokens: list[int], salt: str | None = None) -> ServeRequest:
    return ServeRequest(request_id, tokens, SamplingParams(max_tokens=4).to_dict(), cache_salt=salt)


def test_estimated_queue_drains_at_the_measured_rate_and_never_below_zero():
    assert estimated_queued_tokens(100, 300, 0.0, 5.0) == 400  # no rate measured yet: nothing drains
    assert estimated_queued_tokens(100, 300, 1000.0, 0.1) == 300
    assert estimated_queued_tokens(100, 300, 1000.0, 1.0) == 0
    assert estimated_queued_tokens(100, 0, 1000.0, -1.0) == 100  # a clock a little ahead: no drain


def test_a_prompt_goes_where_its_prefix_is_reported_cached():
    placement = PoolPlacement("cache_aware", "prefill")
    now = time.time()
    cached_on_b = pack_short_hashes(short_hashes(hash_full_blocks(SYSTEM, 16)))
    reports = [prefill("a", report_time=now), prefill("b", report_time=now, cached_blocks=cached_on_b, num_running=1)]
    placement.observe(reports, every_replica=True)
    chosen = placement.place(serve_request("r1", SYSTEM + [7] * 40), reports, {})
    assert chosen.replica_id == "b" and "256 of 296 prompt tokens cached" in chosen.reason
    # Another tenant's salt changes every block hash: no hit, the less loaded replica.
    assert placement.place(serve_request("r2", SYSTEM + [7] * 40, salt="t"), reports, {}).replica_id == "a"


def test_a_burst_within_one_report_period_spreads_then_follows_its_prefix_once_the_queue_drains():
    placement = PoolPlacement("cache_aware", "prefill")
    then = time.time()
    reports = [prefill(name, report_time=then, prefill_tokens_per_s=1000.0) for name in "ab"]
    placement.observe(reports, every_replica=True)
    first = placement.place(serve_request("c0", SYSTEM + [1] * 40), reports, {}).replica_id
    placement.routed(serve_request("c0", SYSTEM + [1] * 40), first)  # Serve sent it there
    # The same system prompt at once: its prefix was routed to `first` (no report says so yet), but
    # the 296 tokens routed there are still queued there: 296 + 40 to compute against 296 elsewhere.
    second = placement.place(serve_request("c1", SYSTEM + [2] * 40), reports, {})
    assert second.replica_id != first and "0 of 296 prompt tokens cached, 0 queued" in second.reason
    # Ten in a burst: queued tokens pile up where they go, so both replicas get some.
    chosen = set()
    for i in range(10):
        burst = serve_request(f"b{i}", [5000 + 64 * i + t for t in range(256)])
        ranked_first = placement.place(burst, reports, {}).replica_id  # no Serve callback yet
        chosen.add(ranked_first)
    assert chosen == {"a", "b"}


def test_a_prompt_is_remembered_once_where_ranked_first_and_also_where_serve_sent_it_instead():
    placement = PoolPlacement("cache_aware", "prefill")
    reports = [prefill(name, report_time=time.time()) for name in "ab"]
    c0 = serve_request("c0", SYSTEM + [1] * 40)
    assert placement.place(c0, reports, {}).replica_id == "a"
    placement.place(c0, reports, {})  # Serve ranks again on a backoff round: not counted twice
    placement.routed(c0, "a")  # and Serve sent it there: nothing more
    assert placement.prefix_index.tokens_routed_since("a", 0.0) == 296
    c1 = serve_request("c1", [9] * 296)
    assert placement.place(c1, reports, {}).replica_id == "b"
    placement.routed(c1, "a")  # b was full: Serve took a
    assert placement.prefix_index.tokens_routed_since("a", 0.0) == 296 + 296
    assert placement.prefix_index.cached_prefix_blocks("a", placement._blocks_of(c1)[0]) == 18


def test_routed_tokens_stop_counting_once_the_replica_had_time_to_compute_them():
    placement = PoolPlacement("cache_aware", "prefill")
    old = time.time() - 2.0  # both reports are two seconds old; a replica computes 1,000 tokens/s
    reports = [prefill("a", report_time=old, prefill_tokens_per_s=1000.0), prefill("b", report_time=old)]
    placement.observe(reports)
    first = placement.place(serve_request("c0", SYSTEM + [1] * 40), reports, {})
    assert first.replica_id == "a"  # tie: the lower id
    placement.routed(serve_request("c0", SYSTEM + [1] * 40), "a")
    # a computed the 296 tokens in 0.3 s, long before now: the prefix alone decides.
    again = placement.place(serve_request("c1", SYSTEM + [2] * 40), reports, {"a": 1})
    assert again.replica_id == "a" and "256 of 296" in again.reason


def test_decode_pools_place_by_load_and_keep_no_prefixes():
    placement = PoolPlacement("cache_aware", "decode")
    reports = [
        ReplicaReport(replica_id="d1", role="decode", num_running=4, num_kv_blocks_free=100, num_kv_blocks_total=100),
        ReplicaReport(replica_id="d2", role="decode", num_running=1, num_kv_blocks_free=100, num_kv_blocks_total=100),
    ]
    assert placement.place(serve_request("r", SYSTEM), reports, {}).replica_id == "d2"
    assert placement.prefix_index.tokens_routed_since("d2", 0.0) == 0
