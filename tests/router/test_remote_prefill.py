"""The router's half of conditional disaggregation: the prefill pool's estimate for a prompt
(router.pool_placement, router.remote_prefill) and the orchestrator carrying it to decode."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from common.block_hash import hash_full_blocks, pack_short_hashes, short_hashes
from common.serving import PrefillResult, RemotePrefillEstimate, ServeRequest
from router.orchestrator import NoObserver, Orchestrator
from router.pool_placement import PoolPlacement
from router.remote_prefill import RemotePrefillEstimator
from tests.router.test_orchestrator import GREEDY, TOKENS, FakeDecode, FakePrefill, FakeStream, tokens
from tests.router.test_pool_placement import SYSTEM, prefill, serve_request


def test_the_estimate_names_the_replica_placement_would_pick_with_its_queue_hit_and_rate():
    placement = PoolPlacement("cache_aware", "prefill")
    now = time.time()
    cached_on_b = pack_short_hashes(short_hashes(hash_full_blocks(SYSTEM, 16)))
    reports = [
        prefill("a", report_time=now, prefill_tokens_per_s=2000.0),
        prefill(
            "b", report_time=now, cached_blocks=cached_on_b, num_prefill_tokens_queued=100, prefill_tokens_per_s=1500.0
        ),
    ]
    placement.observe(reports, every_replica=True)
    request = serve_request("r1", SYSTEM + [7] * 40)
    estimate = placement.estimate(request)
    assert estimate is not None and 90 <= estimate.num_queued_tokens <= 100  # drained since the report
    assert dataclasses.replace(estimate, num_queued_tokens=100) == RemotePrefillEstimate("b", 100, 256, 1500, 0.0)
    queued = estimate.num_queued_tokens
    assert estimate.seconds(296) == pytest.approx((queued + 40) / 1500.0)
    # A read only: the prompt is not remembered as routed, so b's queue has not grown.
    again = placement.estimate(request)
    assert again is not None and again.replica_id == "b" and again.num_queued_tokens <= queued


def test_no_estimate_before_a_prefill_rate_was_measured_or_any_replica_reported():
    placement = PoolPlacement("cache_aware", "prefill")
    assert placement.estimate(serve_request("r1", SYSTEM)) is None
    placement.observe([prefill("a", report_time=time.time())], every_replica=True)
    assert placement.estimate(serve_request("r1", SYSTEM)) is None


def test_the_hand_off_overhead_is_what_the_ttft_spent_outside_prefill_s_queue_and_compute():
    estimator = RemotePrefillEstimator(lambda: None)
    assert estimator.estimate(serve_request("r", SYSTEM)) is None  # no prefill placement yet
    estimator.observe(0.50, PrefillResult("r", 1, 0, queue_time_s=0.10, prefill_time_s=0.30))
    assert estimator.overhead_s == pytest.approx(0.10)
    estimator.observe(0.40, PrefillResult("r", 1, 0, queue_time_s=0.0, prefill_time_s=0.10))
    assert estimator.overhead_s == pytest.approx(0.8 * 0.10 + 0.2 * 0.30)
    estimator.observe(0.40, PrefillResult("r", 1, 0))  # no phases reported: nothing learned
    assert estimator.num_measured == 2


class FakePlacement:
    def __init__(self) -> None:
        self.estimate_of: RemotePrefillEstimate | None = None

    def estimate(self, request: ServeRequest) -> RemotePrefillEstimate | None:
        return self.estimate_of


class LocalWhenAsked(FakeDecode):
    """A decode pool that computes the prompt itself whenever the router sent an estimate."""

    def remote(self, request: ServeRequest) -> FakeStream:
        stream = super().remote(request)
        stream.colocated = request.remote_prefill is not None
        return stream


class Sites(NoObserver):
    def __init__(self) -> None:
        self.sites: list[bool] = []

    def prefill_site(self, local: bool) -> None:
        self.sites.append(local)


def test_the_orchestrator_sends_the_estimate_measures_the_hand_off_and_counts_where_prompts_ran():
    placement, sites = FakePlacement(), Sites()
    decode = LocalWhenAsked([{}, {}])
    prefill_pool = FakePrefill([PrefillResult("req.0", TOKENS[0], 0, queue_time_s=0.0, prefill_time_s=0.0)])
    estimator = RemotePrefillEstimator(lambda: placement)
    orchestrator = Orchestrator(decode, prefill_pool, observer=sites, remote_prefill=estimator)

    async def one() -> list:
        return [d async for d in orchestrator.run("req", [1, 2, 3], GREEDY)]

    # No estimate yet (the prefill pool has not measured its rate): the prefill pool computes it.
    assert tokens(asyncio.run(one())) == TOKENS[:8]
    assert decode.streams[0].request.remote_prefill is None and len(prefill_pool.requests) == 1
    assert prefill_pool.requests[0].remote_prefill is None
    assert estimator.num_measured == 1 and estimator.overhead_s > 0.0  # prefill took 0 s: all of it is hand-off
    # With an estimate, the decode replica may run the prompt: the prefill pool is not called.
    placement.estimate_of = RemotePrefillEstimate("p0", 0, 0, 1000.0, 0.0)
    assert tokens(asyncio.run(one())) == TOKENS[:8]
    sent = decode.streams[1].request.remote_prefill
    assert sent is not None and sent.overhead_s == estimator.overhead_s and sent.replica_id == "p0"
    assert len(prefill_pool.requests) == 1
    assert sites.sites == [False, True]


def test_a_colocated_orchestrator_never_estimates():
    estimator = RemotePrefillEstimator(lambda: pytest.fail("a colocated router has no prefill pool to ask"))
    orchestrator = Orchestrator(FakeDecode([{}], colocated=True), None, remote_prefill=estimator)

    async def one() -> list:
        return [d async for d in orchestrator.run("req", [1, 2, 3], GREEDY)]

    assert tokens(asyncio.run(one())) == TOKENS[:8]


def test_a_failing_placement_costs_the_estimate_not_the_request():
    class Broken:
        def estimate(self, request):
            raise KeyError("a placement bug")

    assert RemotePrefillEstimator(lambda: Broken()).estimate(serve_request("r", SYSTEM)) is None
