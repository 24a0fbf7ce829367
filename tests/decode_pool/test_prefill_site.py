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


def test_a_long_prefill_queue_sends_a_prompt_to_a_busy_decode_replica():
    busy = LocalState(0, 0, 1000.0, num_running=8, decode_step_s=0.03)
    site = choose_prefill_site(50, remote(queued=4000), busy, max_stall_s=0.1)
    assert site.local and site.local_s == pytest.approx(0.05 + 0.03)  # one chunk, one decode step beside it
    # The same prompt with the prefill pool idle: the hand-off costs the running batch nothing.
    assert not choose_prefill_site(50, remote(queued=0, overhead_s=0.0), busy, max_stall_s=0.1).local


def test_a_long_prompt_beside_a_running_batch_costs_a_decode_step_per_chunk():
    busy = LocalState(0, 0, 1000.0, num_running=3, decode_step_s=0.03)
    site = choose_prefill_site(2000, remote(queued=0), busy, max_stall_s=0.1)
    # 20 chunks of 100 tokens (0.1 s at 1,000 tokens/s), each beside a 30 ms decode step.
    assert not site.local and site.local_s == pytest.approx(2.0 + 20 * 0.03) and site.remote_s == pytest.approx(2.05)
    assert "3 running in 30 ms steps, chunks of 100" in site.reason
    # Nothing running: no chunking, so here is sooner than the hand-off.
    assert choose_prefill_site(2000, remote(queued=0), IDLE, max_stall_s=0.1).local
    # A prefill queue of 1,000 tokens makes the chunked prompt the sooner one after all.
    assert choose_prefill_site(2000, remote(queued=1000), busy, max_stall_s=0.1).local


def test_chunks_never_get_smaller_than_the_floor():
    busy = LocalState(0, 0, 1000.0, num_running=2, decode_step_s=0.01)
    site = choose_prefill_site(320, remote(queued=10_000), busy, max_stall_s=0.0)
    assert site.local_s == pytest.approx(0.32 + 10 * 0.01) and "chunks of 32" in site.reason


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


def test_a_burst_of_short_prompts_is_costed_by_their_sum_not_each_alone():
    # 50 uncached tokens behind 90 queued here: 140 tokens, two chunks of 100, two decode steps.
    queued = LocalState(
        num_cached_tokens=0, num_queued_tokens=90, tokens_per_s=1000.0, num_running=4, decode_step_s=0.03
    )
    site = choose_prefill_site(50, remote(queued=100, overhead_s=0.0), queued, max_stall_s=0.1)
    assert site.local_s == pytest.approx(0.14 + 0.06) and not site.local  # remote: 0.15 s
    assert choose_prefill_site(50, remote(queued=200, overhead_s=0.0), queued, max_stall_s=0.1).local  # 0.25 s


def test_the_engine_s_own_chunk_is_what_the_estimate_counts():
    # Not measured here yet: the engine takes the 32-token floor, however fast the prefill pool is.
    unmeasured = LocalState(0, 0, tokens_per_s=0.0, num_running=2, decode_step_s=0.03, chunk_tokens=32)
    site = choose_prefill_site(2000, remote(queued=4000, rate=20_000.0), unmeasured, max_stall_s=0.05)
    assert site.local_s == pytest.approx(0.1 + 63 * 0.03) and not site.local and "chunks of 32" in site.reason
    # From the rate alone the chunks would be 1,000 tokens: two decode steps, and local.
    guessed = LocalState(0, 0, tokens_per_s=0.0, num_running=2, decode_step_s=0.03)
    assert choose_prefill_site(2000, remote(queued=4000, rate=20_000.0), guessed, max_stall_s=0.05).local
