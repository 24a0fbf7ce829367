"""The SLO planner's decisions (router.planner): bursts met at once, the budget shared by need,
scale-down only after a sustained quiet spell, and no oscillation."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from router.planner import Observation, PlannerConfig, PlannerState, PoolState, SLOWindow, plan, pool_state

CONFIG = PlannerConfig(enabled=True, ttft_slo_s=1.0, tpot_slo_s=0.1, cooldown_s=30.0, down_after=3)


def observe(now=0.0, ttft=None, tpot=None, prefill=None, decode=None) -> Observation:
    return Observation(
        now,
        ttft,
        tpot,
        {"prefill": prefill or PoolState(1, prefill_tokens_per_s=4000.0), "decode": decode or PoolState(1)},
    )


def targets(decisions) -> dict[str, int]:
    return {pool: d.target for pool, d in decisions.items()}


def test_a_burst_of_queued_prompt_tokens_gets_every_replica_it_needs_at_once_within_max():
    burst = PoolState(1, queued_prompt_tokens=11_000, prefill_tokens_per_s=4000.0)
    decisions = plan(observe(prefill=burst), CONFIG, PlannerState())
    assert targets(decisions) == {"prefill": 3, "decode": 1}  # 11,000 tokens at 4,000/s within 1 s
    assert "11000 prompt tokens queued need 3 replicas" in decisions["prefill"].reason
    huge = PoolState(1, queued_prompt_tokens=100_000, prefill_tokens_per_s=4000.0)
    decisions = plan(observe(prefill=huge), CONFIG, PlannerState())
    assert decisions["prefill"].target == 4 and "bounded to [1, 4]" in decisions["prefill"].reason


def test_decode_grows_when_reservations_wait_or_kv_runs_high_or_tpot_is_missed():
    for decode, why in (
        (PoolState(2, waiting_for_blocks=3), "3 reservations wait for KV blocks"),
        (PoolState(2, kv_usage=0.9), "KV usage 0.90 > 0.85"),
        (PoolState(2, kv_usage=0.6), "TPOT attainment 0.50 < 0.9"),
    ):
        decisions = plan(observe(tpot=0.5, decode=decode), CONFIG, PlannerState())
        assert decisions["decode"].target == 3 and why in decisions["decode"].reason, decisions["decode"]
    # A TTFT miss is the prefill pool's, whatever decode's load.
    decisions = plan(observe(ttft=0.5, tpot=1.0), CONFIG, PlannerState())
    assert targets(decisions) == {"prefill": 2, "decode": 1}


def test_the_budget_goes_first_to_the_pool_furthest_under_its_target():
    config = PlannerConfig(enabled=True, budget=3)
    # Both want one more; one shard is left: decode's attainment (0.3) is the worse.
    decisions = plan(observe(ttft=0.7, tpot=0.3, decode=PoolState(1, kv_usage=0.5)), config, PlannerState())
    assert targets(decisions) == {"prefill": 1, "decode": 2}
    assert "the budget of 3 allows 0 more" in decisions["prefill"].reason
    # A replica of two shards does not fit in one shard left.
    wide = PoolState(1, shards_per_replica=2, queued_prompt_tokens=9000, prefill_tokens_per_s=4000.0)
    decisions = plan(observe(prefill=wide), config, PlannerState())
    assert decisions["prefill"].target == 1 and "allows 0 more" in decisions["prefill"].reason
    # A pool shrinking frees its shards for the other in the same decision.
    state = PlannerState(down_streak={"prefill": 0, "decode": 5})
    quiet_decode = PoolState(2, kv_usage=0.1)
    decisions = plan(observe(now=100.0, ttft=0.5, decode=quiet_decode), config, state)
    assert targets(decisions) == {"prefill": 2, "decode": 1}


def test_scale_down_waits_for_a_sustained_quiet_spell_and_the_cooldown():
    state = PlannerState()
    quiet = PoolState(3, kv_usage=0.1)
    seen = [targets(plan(observe(now=t, tpot=1.0, decode=quiet), CONFIG, state))["decode"] for t in (0, 10, 20)]
    assert seen == [3, 3, 2]  # the third quiet interval in a row
    # Right after that change the cooldown holds the pool, however quiet.
    quieter = PoolState(2, kv_usage=0.05)
    seen = [targets(plan(observe(now=t, tpot=1.0, decode=quieter), CONFIG, state))["decode"] for t in (22, 24, 26, 50)]
    assert seen == [2, 2, 2, 1]  # three in a row by 26 s, but only 6 s after the change: at 50 s
    # A load that needs its replicas is never shrunk: kv 0.3 over 2 replicas is 0.6 on one, > kv_low.
    state = PlannerState()
    busy = PoolState(2, kv_usage=0.3)
    assert {
        targets(plan(observe(now=t, tpot=1.0, decode=busy), CONFIG, state))["decode"] for t in range(0, 200, 10)
    } == {2}


def test_a_load_that_flaps_every_interval_does_not_make_the_counts_oscillate():
    state = PlannerState()
    replicas, changes = 1, 0
    for step in range(40):
        queued = 9000 if step % 2 == 0 else 0  # a burst every other interval
        prefill = PoolState(replicas, queued_prompt_tokens=queued, prefill_tokens_per_s=4000.0)
        target = plan(observe(now=step * 10.0, prefill=prefill), CONFIG, state)["prefill"].target
        changes += target != replicas
        replicas = target
    assert replicas == 3 and changes == 1  # grown once for the bursts, never shrunk between them


def test_attainment_counts_failures_against_ttft_only_and_too_few_requests_say_nothing():
    window = SLOWindow(ttft_slo_s=1.0, tpot_slo_s=0.1)
    for ok, ttft, tpot in ((True, 0.5, 0.05), (True, 2.0, 0.05), (True, 0.5, 0.3), (False, None, None)):
        window.request_ended(ok, ttft, tpot, prompt_tokens=100)
    assert window.take(min_samples=5) == (None, None, 400)  # four requests, and the window is emptied
    for ok, ttft, tpot in ((True, 0.5, 0.05), (True, 2.0, None), (True, 0.5, 0.3), (True, 0.2, 0.01)):
        window.request_ended(ok, ttft, tpot)
    for _ in range(4):  # refused: TTFT misses, and nothing said of decode's pace
        window.request_ended(False)
    assert window.take(min_samples=4) == (3 / 8, 3 / 4, 0)
    decisions = plan(observe(ttft=None, tpot=None), CONFIG, PlannerState())
    assert targets(decisions) == {"prefill": 1, "decode": 1}


def test_a_pool_as_its_reports_tell_it_leaving_draining_replicas_out():
    reports = [
        {"num_prefill_tokens_queued": 300, "prefill_tokens_per_s": 1000.0, "num_kv_blocks_free": 10,
         "num_kv_blocks_total": 40, "num_waiting_for_blocks": 2},
        {"num_prefill_tokens_queued": 100, "prefill_tokens_per_s": 3000.0, "num_kv_blocks_free": 30,
         "num_kv_blocks_total": 40},
        {"num_prefill_tokens_queued": 999, "draining": True, "num_kv_blocks_total": 40},
    ]  # fmt: skip
    state = pool_state(reports, shards_per_replica=2)
    assert state == PoolState(2, 2, 400, 2000.0, 2, 0.5)
    assert pool_state([]).replicas == 1


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"kv_low": 0.9}, "kv_low < kv_high"),
        ({"min_replicas": {"prefill": 3, "decode": 1}, "max_replicas": {"prefill": 2, "decode": 4}}, "prefill"),
        ({"budget": 1}, "budget"),
        ({"target_attainment": 0}, "target_attainment"),
        ({"down_after": 0}, "down_after"),
    ],
)
def test_bad_planner_settings_are_refused(changes, match):
    with pytest.raises(ConfigError, match=match):
        PlannerConfig(**changes)


def test_the_router_s_loop_resizes_through_its_resize_path_and_exports_each_decision():
    import asyncio

    from prometheus_client import CollectorRegistry, generate_latest

    from router.planner_loop import PlannerLoop

    reports: dict[str, list[dict]] = {"prefill": [{"num_prefill_tokens_queued": 9000, "prefill_tokens_per_s": 4000.0}]}
    resizes: list[dict[str, int]] = []

    async def resize(counts: dict[str, int]) -> dict[str, int]:
        resizes.append(counts)
        if len(resizes) > 1:
            raise RuntimeError("Serve refused")  # logged; the loop goes on
        return counts

    registry = CollectorRegistry()
    loop = PlannerLoop(CONFIG, {"prefill": 1, "decode": 2}, lambda: reports, resize, registry, clock=lambda: 0.0)

    async def intervals() -> list:
        seen = [await loop.tick()]  # decode has not reported yet: nothing is decided
        reports["decode"] = [{"num_kv_blocks_free": 5, "num_kv_blocks_total": 50}]
        seen.append(await loop.tick())
        seen.append(await loop.tick())  # the same burst again: the resize fails, the loop does not
        return seen

    first, second, third = asyncio.run(intervals())
    assert first is None and second is not None and third is not None
    assert second["prefill"].target == 3 and second["decode"].direction == "up"  # KV usage 0.9
    assert resizes == [{"prefill": 3, "decode": 2}] * 2
    text = generate_latest(registry).decode()
    # Counted when Serve ran the resize: the second one failed.
    assert 'pdserve:planner_decisions_total{direction="up",pool="prefill"} 1.0' in text
    assert 'pdserve:planner_target_replicas{pool="decode"} 2.0' in text
    assert loop.status()["prefill"] == {"current": 1, "target": 3, "reason": second["prefill"].reason}


def test_a_steady_load_that_needs_every_prefill_replica_keeps_them_though_the_queue_looks_empty():
    state = PlannerState()
    # Two replicas at 4,000 tokens/s each, 3,000 arriving a second: one replica fewer would run at
    # 75% of its rate, over prefill_low (50%). Each snapshot of the queue happens to be empty.
    busy = PoolState(2, prefill_tokens_per_s=4000.0, prompt_tokens_per_s=3000.0)
    assert {plan(observe(now=t, prefill=busy), CONFIG, state)["prefill"].target for t in range(0, 600, 10)} == {2}
    # 1,000 a second fits one replica under half its rate: shrunk after the quiet spell.
    light = PoolState(2, prefill_tokens_per_s=4000.0, prompt_tokens_per_s=1000.0)
    seen = [plan(observe(now=t, prefill=light), CONFIG, state)["prefill"].target for t in (600, 610, 620)]
    assert seen == [2, 2, 1]
    unknown = PoolState(2, prefill_tokens_per_s=4000.0)  # no interval measured yet: no shrink
    state = PlannerState()
    assert {plan(observe(now=t, prefill=unknown), CONFIG, state)["prefill"].target for t in range(0, 100, 10)} == {2}


def test_a_burst_s_queue_takes_the_budget_before_a_pool_whose_attainment_is_known():
    config = PlannerConfig(enabled=True, budget=3)
    burst = PoolState(1, queued_prompt_tokens=9000, prefill_tokens_per_s=4000.0)
    # Few of the burst's requests have ended (TTFT unknown); decode's TPOT attainment is short.
    decisions = plan(observe(ttft=None, tpot=0.5, prefill=burst), config, PlannerState())
    assert targets(decisions) == {"prefill": 2, "decode": 1}
    assert "the budget of 3 allows 0 more" in decisions["decode"].reason
