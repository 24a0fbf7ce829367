from __future__ import annotations

import copy
import dataclasses
import random

import pytest

from common.errors import ConfigError
from common.serving import ReplicaReport
from router.placement import (
    POLICIES,
    CacheAwarePolicy,
    LeastLoadedPolicy,
    NoReplicaAvailable,
    Placement,
    PlacementPolicy,
    PlacementRequest,
    RandomPolicy,
    make_policy,
    prefill_cost,
)


def report(replica_id: str, role: str = "decode", **fields) -> ReplicaReport:
    defaults = {"num_kv_blocks_free": 100, "num_kv_blocks_total": 100, "max_model_len": 4096}
    return ReplicaReport(replica_id=replica_id, role=role, **{**defaults, **fields})


def request(num_prompt_tokens: int = 32) -> PlacementRequest:
    return PlacementRequest("req-1", num_prompt_tokens)


def test_ranks_by_load_waiting_dominates():
    replicas = [
        report("a", num_waiting=1),  # score 4
        report("b", num_running=3),  # score 3
        report("c", num_running=1, num_reserved=1),  # score 2
        report("d", num_running=5),  # score 5
        report("e"),  # score 0
    ]
    placement = LeastLoadedPolicy().choose(request(), replicas)
    assert placement == Placement("e", placement.reason, ("e", "c", "b", "a", "d"))


def test_ties_broken_by_kv_usage_then_id():
    replicas = [
        report("z", num_running=1, num_kv_blocks_free=50),
        report("y", num_running=1, num_kv_blocks_free=90),
        report("x", num_running=1, num_kv_blocks_free=50),
    ]
    assert LeastLoadedPolicy().choose(request(), replicas).ranking == ("y", "x", "z")


def test_deterministic_regardless_of_input_order_and_does_not_mutate():
    replicas = [report(f"r{i}", num_running=i % 3, num_kv_blocks_free=10 * (i % 2) + 5) for i in range(8)]
    snapshot = copy.deepcopy(replicas)
    policy = LeastLoadedPolicy()
    first = policy.choose(request(), replicas)
    shuffled = list(replicas)
    random.Random(0).shuffle(shuffled)
    assert policy.choose(request(), shuffled) == first
    assert first.ranking == ("r3", "r0", "r6", "r1", "r7", "r4", "r5", "r2")
    assert replicas == snapshot


def test_draining_excluded():
    replicas = [report("idle", draining=True), report("busy", num_running=9)]
    placement = LeastLoadedPolicy().choose(request(), replicas)
    assert (placement.replica_id, placement.ranking) == ("busy", ("busy",))


def test_no_replicas_raises():
    with pytest.raises(NoReplicaAvailable, match="no replicas have reported"):
        LeastLoadedPolicy().choose(request(), [])


def test_all_draining_raises():
    with pytest.raises(NoReplicaAvailable, match="all 2 replicas are draining"):
        LeastLoadedPolicy().choose(request(), [report("a", draining=True), report("b", draining=True)])


def test_a_failed_replica_is_skipped_and_named_when_none_is_left():
    replicas = [report("stopped", engine_error="RuntimeError: shard 1 died"), report("busy", num_running=9)]
    for policy in (LeastLoadedPolicy(), CacheAwarePolicy()):
        assert policy.choose(request(), replicas).ranking == ("busy",)
        prefill = [dataclasses.replace(r, role="prefill") for r in replicas]
        assert policy.choose(request(), prefill).ranking == ("busy",)
    with pytest.raises(NoReplicaAvailable, match=r"1 failed \(their engines stopped\) and 1 are draining"):
        LeastLoadedPolicy().choose(request(), [replicas[0], report("b", draining=True)])


def test_too_long_prompt_excludes():
    replicas = [report("short", max_model_len=100), report("long", num_waiting=3, max_model_len=1000)]
    # 99 prompt tokens + 1 generated fit in 100; 100 + 1 do not.
    assert LeastLoadedPolicy().choose(request(99), replicas).ranking == ("short", "long")
    assert LeastLoadedPolicy().choose(request(100), replicas).ranking == ("long",)
    # max_model_len 0 means "not reported": no limit applied.
    assert LeastLoadedPolicy().choose(request(10**6), [report("unknown", max_model_len=0)]).replica_id == "unknown"


def test_too_long_everywhere_raises_with_numbers():
    replicas = [report("a", max_model_len=100), report("b", max_model_len=200), report("c", draining=True)]
    with pytest.raises(NoReplicaAvailable) as info:
        LeastLoadedPolicy().choose(request(500), replicas)
    message = str(info.value)
    assert "500 tokens" in message and "1 draining" in message and "at most 200 tokens" in message


def test_kv_full_decode_ranked_last():
    # 32 prompt tokens + 1 = 33 tokens = 3 blocks of 16.
    replicas = [
        report("full", num_kv_blocks_free=2),
        report("roomy", num_waiting=2, num_kv_blocks_free=3),
        report("fuller", num_kv_blocks_free=0),
    ]
    placement = LeastLoadedPolicy(block_size=16).choose(request(32), replicas)
    assert placement.ranking == ("roomy", "full", "fuller")
    # With 64-token blocks one block holds the prompt: only "fuller" lacks room.
    assert LeastLoadedPolicy(block_size=64).choose(request(32), replicas).ranking == ("full", "roomy", "fuller")


def test_kv_full_only_matters_for_decode():
    replicas = [report("p1", role="prefill", num_kv_blocks_free=0), report("p2", role="prefill", num_running=1)]
    assert LeastLoadedPolicy().choose(request(), replicas).ranking == ("p1", "p2")


def test_reason_names_the_numbers():
    replicas = [report("a", num_waiting=0, num_running=1, num_reserved=2, num_kv_blocks_free=88)]
    placement = LeastLoadedPolicy().choose(request(), replicas)
    assert placement.reason == "least loaded: 0 waiting, 1 running, 2 reserved, KV 12% used"


def test_reason_says_when_no_replica_has_room():
    placement = LeastLoadedPolicy().choose(request(32), [report("a", num_kv_blocks_free=1)])
    assert placement.replica_id == "a"
    assert "no decode replica has 3 free KV blocks (1 here)" in placement.reason


def test_make_policy():
    policy = make_policy("least_loaded", block_size=32)
    assert isinstance(policy, LeastLoadedPolicy) and isinstance(policy, PlacementPolicy)
    assert (policy.name, policy.block_size) == ("least_loaded", 32)
    assert set(POLICIES) == {"least_loaded", "cache_aware", "random"}


def test_unknown_policy_names_known_ones():
    known = "cache_aware, least_loaded, random"
    with pytest.raises(ConfigError, match=rf"unknown placement policy 'round_robin'; set it to one of: {known}"):
        make_policy("round_robin")


@pytest.mark.parametrize("block_size", [0, -16, 1.5, True])
def test_bad_block_size(block_size):
    with pytest.raises(ConfigError, match="block_size"):
        LeastLoadedPolicy(block_size=block_size)


def test_policy_contract_is_abstract():
    with pytest.raises(TypeError):
        PlacementPolicy()  # type: ignore[abstract]


# --- cache-aware ------------------------------------------------------------------------------
def prefill(replica_id: str, **fields) -> ReplicaReport:
    return report(replica_id, role="prefill", **fields)


def test_prefill_cost_is_queued_tokens_plus_the_uncached_prompt():
    assert prefill_cost(1000, 0, 0) == 1000
    assert prefill_cost(1000, 768, 0) == 232
    assert prefill_cost(1000, 768, 500) == 732
    assert prefill_cost(100, 200, 0) == 0  # never negative


def test_cache_aware_prefers_the_replica_holding_the_prefix_unless_its_queue_costs_more():
    policy = CacheAwarePolicy()
    replicas = [prefill("a", num_running=2), prefill("b"), prefill("c", num_prefill_tokens_queued=100)]
    hit_on_a = PlacementRequest("r", 1000, {"a": 768})
    placement = policy.choose(hit_on_a, replicas)
    # a: 232 tokens to compute although it is the busiest; b: 1000; c: 100 + 1000
    assert placement.ranking == ("a", "b", "c")
    assert "768 of 1000 prompt tokens cached" in placement.reason
    # a prefill queue longer than the hit saves: the idle replica wins
    replicas[0] = prefill("a", num_prefill_tokens_queued=900)
    assert policy.choose(hit_on_a, replicas).ranking == ("b", "c", "a")  # 1000, 1100, 1132


def test_cache_aware_without_hits_is_least_loaded_and_keeps_its_eligibility_rules():
    policy = CacheAwarePolicy()
    replicas = [prefill("a", num_running=3), prefill("b", num_waiting=1), prefill("c", num_running=1)]
    assert policy.choose(request(), replicas).ranking == LeastLoadedPolicy().choose(request(), replicas).ranking
    replicas.append(prefill("d", draining=True))
    replicas.append(prefill("e", max_model_len=16))
    assert set(policy.choose(PlacementRequest("r", 32, {"d": 32, "e": 32}), replicas).ranking) == {"a", "b", "c"}
    with pytest.raises(NoReplicaAvailable):
        policy.choose(request(), [prefill("d", draining=True)])


def test_a_hit_never_counts_the_prompt_s_last_token():
    # The engine computes at least the last prompt token: a whole-prompt hit saves all but one.
    placement = CacheAwarePolicy().choose(PlacementRequest("r", 64, {"a": 64}), [prefill("a")])
    assert "63 of 64 prompt tokens cached" in placement.reason


def test_cache_aware_places_decode_as_least_loaded():
    replicas = [report("a", num_running=1), report("b", num_kv_blocks_free=0), report("c")]
    ranked = CacheAwarePolicy().choose(PlacementRequest("r", 32, {"b": 32}), replicas).ranking
    assert ranked == LeastLoadedPolicy().choose(request(), replicas).ranking == ("c", "a", "b")


def test_random_is_deterministic_per_request_and_spreads_requests():
    policy = RandomPolicy()
    replicas = [prefill(name) for name in "abcd"]
    first = policy.choose(PlacementRequest("req-7", 32), replicas)
    assert policy.choose(PlacementRequest("req-7", 32), list(reversed(replicas))) == first
    chosen = {policy.choose(PlacementRequest(f"req-{i}", 32), replicas).replica_id for i in range(64)}
    assert chosen == set("abcd")
