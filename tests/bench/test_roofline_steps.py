"""bench.roofline times decode steps of the whole batch: no sequence may finish while timed."""

from __future__ import annotations

from bench.common import exact_length_prompts
from bench.roofline import time_decode
from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine


def test_every_timed_decode_step_runs_the_whole_batch(tiny_dir):
    # A budget of 64 tokens brings 12 prompts of 40 in over 8 steps, each sampling a token for the
    # prompts already in: with too little room in max_tokens the first ones finished while timed.
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tiny_dir), dtype="float32"),
            cache=CacheConfig(kv_cache_memory=1 << 26, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=64),
        )
    )
    try:
        prompts = exact_length_prompts(engine.tokenizer, 12, 40)
        batch_sizes: list[int] = []
        original_step = engine.step

        def counting_step():
            batch_sizes.append(len(engine.scheduler.running))
            return original_step()

        engine.step = counting_step  # type: ignore[method-assign]
        pairs, context = time_decode(engine, prompts, 6, lambda: 1.0)
    finally:
        engine.shutdown()
    assert len(pairs) == 6 and all(seconds > 0 for seconds, _ in pairs)
    assert batch_sizes.count(12) >= 6  # the timed steps (the asserts inside check each one)
    assert 40 < context < 40 + 6 + 8 + 2
