"""Async scheduling (SchedulerConfig.async_scheduling, on by default on CUDA): the next step is
scheduled and queued before the current one's sampled ids are read, its decodes' input ids taken
from those ids on the device. On CPU the kernels return when done, so the overlap is not
measurable here; what is tested is the protocol (the next step is launched before the current one
is read) and that clients see exactly what the synchronous loop gives them: tokens, text,
logprobs, seeded samples, stop strings and stop tokens found a step late, aborts, penalties (run in
step), block shortage (a step ahead never preempts), the prefix cache (a placeholder is never
hashed) and the decode role. No block is leaked."""

from __future__ import annotations

import pytest

from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine import SamplingParams
from engine.llm_engine import LLMEngine
from engine.request import PLACEHOLDER_TOKEN
from engine.sampler import PendingSample
from tests.engine.test_overlap_outputs import PROMPTS, stream, summary

pytestmark = pytest.mark.slow


def make_engine(model_dir, ahead: bool, kv_bytes: int = 32 * 2**20, **scheduler) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype="float32"),
            cache=CacheConfig(kv_cache_memory=kv_bytes),
            scheduler=SchedulerConfig(
                **{"max_num_seqs": 8, "max_num_batched_tokens": 64, **scheduler},
                async_scheduling=ahead,
                overlap_outputs=ahead,
            ),
        )
    )


@pytest.fixture(scope="module")
def engines(tiny_dir):
    pair = {ahead: make_engine(tiny_dir, ahead) for ahead in (False, True)}
    yield pair
    for engine in pair.values():
        engine.shutdown()


@pytest.fixture(autouse=True)
def no_leaks(engines):
    yield
    for engine in engines.values():
        assert not engine.has_unfinished_requests()
        assert engine.num_blocks_held() == 0
        engine.check_integrity()


def both(engines, requests, **kwargs):
    """The synchronous loop's and the async loop's outputs, and the steps the async one queued ahead."""
    plain = summary(stream(engines[False], requests, **kwargs))
    before = engines[True].num_steps_ahead
    ahead = summary(stream(engines[True], requests, **kwargs))
    return plain, ahead, engines[True].num_steps_ahead - before


def test_outputs_equal_the_synchronous_loop_greedy_sampled_and_with_logprobs(engines):
    long_prompt = " ".join(["token"] * 150)  # three 64-token chunks: steps ahead mix prompt and decodes
    requests = {
        f"r{i}": (prompt, SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, logprobs=2 if i % 2 else None))
        for i, prompt in enumerate(PROMPTS)
    }
    requests["seeded"] = (PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, logprobs=1))
    requests["long"] = (long_prompt, SamplingParams(max_tokens=5, temperature=0.0))
    plain, ahead, steps_ahead = both(engines, requests)
    assert ahead == plain
    assert steps_ahead >= 20
    for request_id, (ids, text, reason, streamed_ids, streamed_text, _) in plain.items():
        assert streamed_ids == ids and streamed_text == text and reason == "length", request_id
        assert PLACEHOLDER_TOKEN not in ids


def test_a_stop_token_and_a_stop_string_end_the_request_at_the_same_token(engines):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    free_ids, free_text = summary(stream(engines[False], {"free": (PROMPTS[0], params)}))["free"][:2]
    stop = free_text[len(free_text) // 2 : len(free_text) // 2 + 3]
    requests = {
        "stop token": (PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[free_ids[9]])),
        "stop string": (PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])),
        "beside": (PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.0)),
    }
    plain, ahead, steps_ahead = both(engines, requests)
    assert plain["stop token"][2] == "stop" and len(plain["stop token"][0]) <= 10
    assert plain["stop string"][2] == "stop" and stop not in plain["stop string"][1]
    assert ahead == plain and steps_ahead > 0


def test_an_aborted_request_keeps_its_made_tokens_and_frees_its_blocks(engines):
    requests = {
        "kept": (PROMPTS[2], SamplingParams(max_tokens=16, temperature=0.0)),
        "aborted": (PROMPTS[3], SamplingParams(max_tokens=40, temperature=0.0)),
    }
    plain, ahead, _ = both(engines, requests, abort_after={"aborted": 6})
    assert plain["aborted"][2] == "abort"
    assert ahead == plain


def test_a_request_with_penalties_runs_in_step_and_gets_the_same_tokens(engines):
    requests = {
        "penalized": (PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3)),
        "plain": (PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0)),
    }
    plain, ahead, _ = both(engines, requests)
    assert ahead == plain
    # Alone, a penalized request never has a step scheduled before its tokens are read.
    alone = {"alone": (PROMPTS[2], SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=0.5))}
    plain, ahead, steps_ahead = both(engines, alone)
    assert ahead == plain and steps_ahead <= 1  # the prompt's step, before the request sampled once


def test_the_next_step_is_queued_before_the_current_ones_ids_are_read(engines, monkeypatch):
    engine = engines[True]
    events: list[str] = []
    real_read, real_emit, real_launch = PendingSample.read, engine._emit_new_tokens, engine.sampler.launch

    def read(self):
        events.append("read")
        return real_read(self)

    def emit(request):
        events.append(f"emit:{request.num_output_tokens}")
        return real_emit(request)

    def launch(logits, rows, mask=None):
        events.append("launch")
        return real_launch(logits, rows, mask)

    monkeypatch.setattr(PendingSample, "read", read)
    monkeypatch.setattr(engine, "_emit_new_tokens", emit)
    monkeypatch.setattr(engine.sampler, "launch", launch)
    stream(engine, {"one": (PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))})
    # The prompt's step samples token 1; the decode of token 1 is queued before token 1 is read,
    # and so on; token 4 ends the request by length, known before it is read: nothing after it.
    assert events == [
        "launch", "launch", "read", "emit:1",
        "launch", "read", "emit:2",
        "launch", "read", "emit:3",
        "read", "emit:4",
    ]  # fmt: skip


def test_placeholders_are_never_hashed_into_the_prefix_cache(engines):
    """A placeholder that completes a block must not be hashed: the cached blocks of a finished
    request are the synchronous loop's, so the same tokens hit them again."""
    params = SamplingParams(max_tokens=40, temperature=0.0)  # crosses block boundaries (16) while decoding
    cached = {}
    for ahead, engine in engines.items():
        engine.add_request("hashed", PROMPTS[3], params)
        request = engine.scheduler.requests["hashed"]
        while engine.has_unfinished_requests():
            engine.step()
        cached[ahead] = engine.kv.cached_prefix_tokens(request.all_token_ids, None)
        assert PLACEHOLDER_TOKEN not in request.all_token_ids
    assert cached[True] == cached[False] >= 32


def test_block_shortage_never_preempts_a_step_ahead_and_loses_nothing(tiny_dir):
    """A cache of a few blocks: steps ahead that find no room leave requests out (``blocked``) and
    the step after preempts; every request still gets the synchronous loop's greedy tokens."""
    small = {ahead: make_engine(tiny_dir, ahead, kv_bytes=40 * 2**10, max_num_seqs=4) for ahead in (False, True)}
    try:
        blocks = small[True].layout.num_blocks
        assert blocks <= 12, f"{blocks} blocks: too many to run short"
        requests = {
            f"r{i}": (prompt, SamplingParams(max_tokens=40, temperature=0.0)) for i, prompt in enumerate(PROMPTS)
        }
        plain, ahead, steps_ahead = both(small, requests)
        assert ahead == plain and steps_ahead > 0
        assert small[True].num_preemptions > 0
        for engine in small.values():
            assert engine.num_blocks_held() == 0
            engine.check_integrity()
    finally:
        for engine in small.values():
            engine.shutdown()


def test_a_prefill_replica_and_tensor_parallel_shards_never_schedule_ahead(tiny_dir):
    from common.config import EngineRole

    prefill = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tiny_dir), dtype="float32"),
            cache=CacheConfig(kv_cache_memory=8 * 2**20),
            scheduler=SchedulerConfig(role=EngineRole.PREFILL, async_scheduling=True),
        )
    )
    try:
        assert not prefill.async_scheduling
    finally:
        prefill.shutdown()
