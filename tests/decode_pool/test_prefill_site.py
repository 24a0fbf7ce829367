"""Conditional disaggregation's decision (decode_pool.prefill_site), as a pure function."""

from __future__ import annotations

import pytest

from common.serving import RemotePrefillEstimate
from decode_pool.prefill_site import LocalState, choose_prefill_site


def remote(queued: int = 0, cached: int = 0, rate: float = 1000.0, overhead_s: float = 0.05) -> RemotePrefillEstimate:
    return RemotePrefillEstimate("p0", queued, cached, rate, overhead_s)


IDLE = LocalState(num_cached_tokens=0, num_queued_tokens=0, tokens_per_s=1000.0, num_running=0)


def test_an_idle_decode_replica_computes_a_prompt_itself_rather_than_pay_the_hand_off():
    site = choose_prefill_site(200, remote(), IDLE, max_stall_s=0.1)
    assert site.local and site.name == "local"
    assert site.local_s == pytest.approx(0.2) and site.remote_s == pytest.approx(0.25)
    assert "prefill replica p0" in site.reason


def test_a_long_prefill_queue_sends_a_prompt_to_a_busy_decode_replica_within_the_stall_bound():
    busy = LocalState(0, 0, 1000.0, num_running=8)
    assert choose_prefill_site(50, remote(queued=4000), busy, max_stall_s=0.1).local  # 50 ms stall
    # The same prompt with the prefill pool idle: the hand-off is cheaper than the stall it saves nobody.
    assert not choose_prefill_site(50, remote(queued=0, overhead_s=0.0), busy, max_stall_s=0.1).local


def test_a_long_prompt_stays_remote_when_it_would_stall_the_running_batch():
    busy = LocalState(0, 0, 1000.0, num_running=3)
    site = choose_prefill_site(2000, remote(queued=10_000), busy, max_stall_s=0.1)
    assert not site.local and "stall 3 running requests 2000 ms" in site.reason
    # Nothing running: nobody is stalled, and the queue makes local sooner.
    assert choose_prefill_site(2000, remote(queued=10_000), IDLE, max_stall_s=0.1).local


def test_a_large_local_prefix_hit_makes_a_long_prompt_cheap_here():
    # Multi-turn chat: this replica holds the conversation so far (the last answer included).
    warm = LocalState(num_cached_tokens=1984, num_queued_tokens=0, tokens_per_s=1000.0, num_running=4)
    site = choose_prefill_site(2000, remote(cached=1024), warm, max_stall_s=0.1)
    assert site.local and site.local_s == pytest.approx(0.016)


def test_the_prefill_pool_wins_when_its_cache_holds_what_this_replica_would_compute():
    site = choose_prefill_site(2000, remote(cached=1984, overhead_s=0.01), IDLE, max_stall_s=1.0)
    assert not site.local and site.reason.startswith("remote: faster there")


def test_a_replica_that_never_prefilled_is_assumed_as_fast_as_the_remote_one():
    unmeasured = LocalState(0, num_queued_tokens=0, tokens_per_s=0.0, num_running=0)
    slow_remote = remote(rate=100.0, overhead_s=0.0)
    site = choose_prefill_site(100, slow_remote, unmeasured, max_stall_s=0.1)
    assert site.local_s == pytest.approx(1.0) == site.remote_s and site.local  # a tie stays here


def test_the_local_queue_counts_against_computing_here():
    queued_here = LocalState(0, num_queued_tokens=3000, tokens_per_s=1000.0, num_running=0)
    assert not choose_prefill_site(100, remote(queued=1000), queued_here, max_stall_s=0.1).local


def test_a_burst_of_short_prompts_stalls_the_batch_by_their_sum_not_each_alone():
    # 50 uncached tokens alone would stall 50 ms; behind 90 queued here, 140 ms: over the bound.
    queued = LocalState(num_cached_tokens=0, num_queued_tokens=90, tokens_per_s=1000.0, num_running=4)
    site = choose_prefill_site(50, remote(queued=4000), queued, max_stall_s=0.1)
    assert not site.local and "stall 4 running requests 140 ms" in site.reason
