"""Scheduler with a fake model: budgets, chunked prefill, seats, preemption, roles, aborts."""

from __future__ import annotations

import pytest

from common.config import EngineRole, SchedulerConfig
from common.sampling_params import SamplingParams
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler

BS = 4
EOS = 0


def fake_token(request_id: str, position: int) -> int:
    return 1000 + (hash((request_id, position)) % 1000)  # never EOS


def make(scheduler_kwargs=None, num_blocks=64, max_model_len=1024) -> Scheduler:
    config = SchedulerConfig(**(scheduler_kwargs or {}))
    return Scheduler(config, KVCacheManager(num_blocks, BS), max_model_len)


def request(request_id: str, num_prompt: int, max_tokens: int = 4, **params) -> Request:
    prompt = [(7 * i + len(request_id)) % 500 + 1 for i in range(num_prompt)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=frozenset({EOS}))


def run_step(s: Scheduler, tokens: dict[str, int] | None = None):
    out = s.schedule()
    sampled = {
        c.request_id: (tokens or {}).get(c.request_id, fake_token(c.request_id, c.start_position))
        for c in out.chunks
        if c.samples
    }
    updated = s.update_from_output(out, sampled)
    s.kv.check_integrity()
    return out, updated


def run_all(s: Scheduler, max_steps: int = 10_000) -> list:
    steps = []
    while s.has_unfinished_requests():
        steps.append(run_step(s)[0])
        assert len(steps) < max_steps, "scheduler made no progress"
    return steps


def test_token_budget_and_chunked_prefill():
    s = make({"max_num_batched_tokens": 16, "max_prefill_chunk": 8})
    s.add_request(long := request("long", 30, max_tokens=3))
    s.add_request(short := request("short", 5, max_tokens=3))
    steps = run_all(s)
    assert all(step.num_batched_tokens <= 16 for step in steps)
    long_chunks = [c for step in steps for c in step.chunks if c.request_id == "long"]
    assert [len(c.token_ids) for c in long_chunks] == [8, 8, 8, 6, 1, 1]
    assert [c.samples for c in long_chunks] == [False, False, False, True, True, True]
    assert [c.start_position for c in long_chunks] == [0, 8, 16, 24, 30, 31]
    assert long.status is RequestStatus.FINISHED_LENGTH and long.num_output_tokens == 3
    assert short.num_output_tokens == 3
    assert s.kv.num_held_blocks() == 0


def test_max_num_seqs_limits_running():
    s = make({"max_num_seqs": 2})
    for i in range(5):
        s.add_request(request(f"r{i}", 3, max_tokens=5))
    for step in run_all(s):
        assert len(step.chunks) <= 2
    assert s.kv.num_held_blocks() == 0


def test_preemption_by_recompute_finishes_everything():
    # 12 blocks of 4 tokens; four requests that each grow to 4 + 20 tokens cannot all fit at once.
    s = make({"max_num_batched_tokens": 64}, num_blocks=12)
    reqs = [request(f"r{i}", 4, max_tokens=20) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    steps = run_all(s)
    preempted = [rid for step in steps for rid in step.preempted_request_ids]
    assert preempted, "the scenario must force preemption"
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 20 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) == len(preempted)
    # A preempted request recomputes its prompt and generated tokens (from its cached prefix, if any).
    victim = preempted[0]
    k = next(i for i, step in enumerate(steps) if victim in step.preempted_request_ids)
    resumed = next(c for step in steps[k + 1 :] for c in step.chunks if c.request_id == victim)
    assert len(resumed.token_ids) > 1 and resumed.start_position % BS == 0
    assert s.kv.num_held_blocks() == 0


def test_single_request_larger_than_step_budget_makes_progress():
    s = make({"max_num_batched_tokens": 4}, num_blocks=8)
    s.add_request(r := request("r", 20, max_tokens=2))
    run_all(s)
    assert r.num_output_tokens == 2


def test_eos_and_stop_token_ids():
    s = make()
    s.add_request(a := request("a", 3, max_tokens=10))
    s.add_request(b := request("b", 3, max_tokens=10, stop_token_ids=[42]))
    s.add_request(c := request("c", 3, max_tokens=10, ignore_eos=True))
    run_step(s, {"a": EOS, "b": 42, "c": EOS})
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason is None
    assert b.status is RequestStatus.FINISHED_STOPPED and b.stop_reason == 42
    assert c.status is RequestStatus.RUNNING
    s.finish_request("c", RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_held_blocks() == 0


def test_prefill_role_holds_blocks_until_release():
    s = make({"role": EngineRole.PREFILL})
    s.add_request(r := request("p", 10, max_tokens=50))
    _out, updated = run_step(s)
    assert updated == [r] and r.status is RequestStatus.FINISHED_PREFILLED and r.num_output_tokens == 1
    assert s.kv.block_ids("p") and s.kv.num_held_blocks() == 3
    assert not s.has_unfinished_requests()
    s.release("p")
    assert s.kv.num_held_blocks() == 0
    assert s.release("p") is None  # idempotent


def test_decode_role_reserve_then_kv_ready_decodes_without_prefill():
    s = make({"role": EngineRole.DECODE}, num_blocks=8)
    r = request("d", 10, max_tokens=4)
    block_ids = s.reserve(r)
    assert block_ids is not None and len(block_ids) == 3
    assert s.schedule().is_empty  # nothing to run until the KV arrives
    s.kv_ready("d", first_token_id=123)
    steps = run_all(s)
    chunks = [c for step in steps for c in step.chunks]
    assert [(c.start_position, len(c.token_ids)) for c in chunks] == [(10, 1), (11, 1), (12, 1)]
    assert chunks[0].token_ids == [123] and chunks[0].block_ids[:3] == block_ids
    assert r.output_token_ids[0] == 123 and r.num_output_tokens == 4
    assert s.kv.num_held_blocks() == 0


def test_decode_role_reserve_refuses_when_full_and_kv_failure_frees():
    s = make({"role": EngineRole.DECODE}, num_blocks=4)
    assert s.reserve(request("big", 20)) is None  # needs 5 blocks
    assert s.kv.num_held_blocks() == 0
    assert s.reserve(request("ok", 8)) is not None
    s.finish_request("ok", RequestStatus.FINISHED_ERROR, error="kv transfer failed")
    assert s.kv.num_held_blocks() == 0 and not s.has_unfinished_requests()


def test_decode_role_first_token_can_finish_immediately():
    s = make({"role": EngineRole.DECODE})
    s.reserve(request("one", 5, max_tokens=1))
    r = s.kv_ready("one", first_token_id=77)
    assert r.status is RequestStatus.FINISHED_LENGTH and s.kv.num_held_blocks() == 0


@pytest.mark.parametrize("when", ["waiting", "running", "mid_prefill"])
def test_abort_frees_blocks_in_every_state(when):
    s = make({"max_num_batched_tokens": 8, "max_prefill_chunk": 4})
    s.add_request(r := request("x", 12, max_tokens=5))
    if when != "waiting":
        run_step(s)
        if when == "running":
            while r.num_computed_tokens < r.num_prompt_tokens:
                run_step(s)
    s.finish_request("x", RequestStatus.FINISHED_ABORTED)
    assert r.status is RequestStatus.FINISHED_ABORTED
    assert s.kv.num_held_blocks() == 0 and not s.has_unfinished_requests()
    s.kv.check_integrity()


def test_prefix_cache_hit_skips_computed_tokens():
    s = make()
    s.add_request(request("a", 12, max_tokens=1))
    run_all(s)
    s.add_request(b := request("b", 12, max_tokens=1))  # same prompt (same id length)
    out = s.schedule()
    assert out.chunks[0].start_position == 8 and len(out.chunks[0].token_ids) == 4
    assert b.num_cached_tokens == 8


def test_decode_role_kv_ready_requests_holding_blocks_cannot_deadlock():
    # 4 blocks of 4 tokens: two 8-token prompts fill the cache; each then needs a fifth block.
    s = make({"role": EngineRole.DECODE}, num_blocks=4)
    a, b = request("a", 8, max_tokens=3), request("b", 8, max_tokens=3)
    assert s.reserve(a) is not None and s.reserve(b) is not None
    s.kv_ready("a", 101)
    s.kv_ready("b", 102)
    run_all(s, max_steps=200)
    assert a.num_output_tokens == 3 and b.num_output_tokens == 3
    assert a.num_preemptions + b.num_preemptions >= 1  # one gave its blocks up and recomputed
    assert s.kv.num_held_blocks() == 0


def test_kv_ready_after_abort_is_ignored():
    s = make({"role": EngineRole.DECODE})
    s.reserve(request("gone", 5))
    s.finish_request("gone", RequestStatus.FINISHED_ABORTED)
    assert s.kv_ready("gone", 7) is None
    assert s.kv.num_held_blocks() == 0


def test_prefix_hit_stats_count_each_admitted_request_once():
    s = make({"max_num_seqs": 1})
    s.add_request(request("a", 12, max_tokens=3))
    s.add_request(request("b", 12, max_tokens=3))  # waits several steps for a seat: looked up each time
    run_all(s)
    stats = s.kv.pool.stats()
    assert stats.num_queried_tokens == 24 and stats.num_hit_tokens == 8


def run_capped(s: Scheduler, cap: int):
    out = s.schedule(prompt_token_cap=cap)
    sampled = {c.request_id: fake_token(c.request_id, c.start_position) for c in out.chunks if c.samples}
    s.update_from_output(out, sampled)
    s.kv.check_integrity()
    return out


def prompt_tokens(out) -> int:
    return sum(len(c.token_ids) for c in out.chunks if c.in_prompt)


def test_the_prompt_cap_holds_only_beside_decoding_requests():
    s = make()
    s.add_request(request("alone", 40, max_tokens=20))
    first = run_capped(s, cap=8)
    assert prompt_tokens(first) == 40  # nothing decoding yet: the whole prompt in one step
    s.add_request(request("beside", 30, max_tokens=2))
    chunks = []
    while "beside" in s.requests:
        out = run_capped(s, cap=8)
        assert "alone" in [c.request_id for c in out.chunks if not c.in_prompt]  # its token every step
        assert prompt_tokens(out) <= 8
        chunks += [len(c.token_ids) for c in out.chunks if c.request_id == "beside"]
    assert chunks == [8, 8, 8, 6, 1]
    assert s.kv.num_held_blocks() == len(s.kv.block_ids("alone"))


def test_the_prompt_cap_is_shared_by_every_prompt_in_the_step():
    s = make()
    s.add_request(request("decoding", 4, max_tokens=30))
    run_capped(s, cap=8)
    s.add_request(request("a", 10, max_tokens=1))
    s.add_request(request("bb", 10, max_tokens=1))  # another prompt (request() keys it by the id's length)
    out = run_capped(s, cap=8)
    assert prompt_tokens(out) == 8 and [c.request_id for c in out.chunks] == ["decoding", "a"]
    out = run_capped(s, cap=8)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("decoding", 1), ("a", 2), ("bb", 6)]


def test_a_decode_ready_request_is_admitted_past_a_prompt_held_back_by_the_cap():
    s = make({"role": EngineRole.DECODE})
    s.add_request(request("local", 40, max_tokens=1))  # computed here (conditional disaggregation)
    s.reserve(request("remote", 8, max_tokens=3))
    s.kv_ready("remote", first_token_id=5)  # queued behind the local prompt
    assert s.num_decoding() == 1  # waiting, but past its prompt: a local prompt would run beside it
    out = run_capped(s, cap=8)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("local", 8), ("remote", 1)]
    s.add_request(request("late", 12, max_tokens=1))
    out = run_capped(s, cap=8)
    # The running prompt takes the cap; the newer one waits without blocking anyone.
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("local", 8), ("remote", 1)]
    run_all(s)
    assert s.kv.num_held_blocks() == 0


# --- the priority policy -------------------------------------------------------------------
def test_priority_policy_admits_the_most_urgent_waiting_request_first():
    s = make({"policy": "priority", "max_num_seqs": 1})
    for request_id, priority in (("late-low", 5), ("urgent", -2), ("mid", 0), ("urgent-2", -2)):
        s.add_request(request(request_id, 4, priority=priority))
    order = []
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        order.extend(c.request_id for c in out.chunks if c.start_position == 0)
    assert order == ["urgent", "urgent-2", "mid", "late-low"]  # ties by arrival


def test_fcfs_ignores_priority_order_and_priority_policy_preempts_the_least_urgent():
    fcfs = make({"max_num_seqs": 1})
    for request_id, priority in (("a", 5), ("b", -2)):
        fcfs.add_request(request(request_id, 4, priority=priority))
    out, _ = run_step(fcfs)
    assert [c.request_id for c in out.chunks] == ["a"]

    # Two running requests outgrow 4 blocks of 4 tokens: the less urgent one is preempted, though
    # it was admitted first (fcfs would preempt the one admitted last).
    s = make({"policy": "priority"}, num_blocks=4)
    s.add_request(request("background", 6, max_tokens=8, priority=9))
    s.add_request(request("interactive", 6, max_tokens=8, priority=0))
    preempted = []
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        preempted.extend(out.preempted_request_ids)
    assert preempted and set(preempted) == {"background"}


def test_the_priority_policy_is_a_known_name():
    with pytest.raises(Exception, match="scheduling policy"):
        SchedulerConfig(policy="lottery")
