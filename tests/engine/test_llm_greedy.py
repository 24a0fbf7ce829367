"""The oracle: greedy output equals transformers' greedy output token for token, in float32."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.conftest import PROMPTS, long_text

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# 1 to 1,000+ tokens; several sit on either side of 16-token block boundaries.
MIXED_LENGTHS = [1, 2, 7, 15, 16, 17, 31, 33, 64, 100, 161, 257, 400, 600, 800, 1030]


@pytest.fixture(scope="module")
def llm(smol_dir):
    with LLM(str(smol_dir), kv_cache_memory=256 * 2**20) as instance:
        yield instance
        assert instance.engine.num_blocks_held() == 0
        instance.engine.check_integrity()


@pytest.fixture(scope="module")
def mixed_prompts(llm) -> list[list[int]]:
    ids = llm.tokenizer.encode(long_text(40))
    assert len(ids) > max(MIXED_LENGTHS)
    # Different starting offsets, so prompts share no prefix by accident.
    return [ids[i * 13 : i * 13 + n] for i, n in enumerate(MIXED_LENGTHS)]


def assert_matches_oracle(outputs, prompts, hf_model, hf_reference, max_tokens):
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_reference(hf_model, list(prompt), max_tokens)
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"


def test_single_prompts(llm, hf_smol, hf_reference):
    for text in PROMPTS:
        (output,) = llm.generate(text, GREEDY)
        ids = llm.tokenizer.encode(text)
        assert output.outputs[0].token_ids == hf_reference(hf_smol, ids, 12)
        assert output.outputs[0].text == llm.tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
        assert output.outputs[0].finish_reason in ("length", "stop")
        assert output.prompt == text and output.finished


def test_batch_of_16_mixed_lengths(llm, mixed_prompts, hf_smol, hf_reference):
    outputs = llm.generate(mixed_prompts, GREEDY)
    assert_matches_oracle(outputs, mixed_prompts, hf_smol, hf_reference, 12)


def test_prefix_cache_hit_gives_same_tokens(llm, mixed_prompts, hf_smol, hf_reference):
    prompt = mixed_prompts[-3]  # 600 tokens
    llm.generate([prompt], GREEDY)
    extended = prompt + llm.tokenizer.encode(" And so the keeper climbed the stairs.")
    (output,) = llm.generate([extended], GREEDY)
    assert output.num_cached_tokens >= 16 * (len(prompt) // 16)
    assert_matches_oracle([output], [extended], hf_smol, hf_reference, 12)


def test_chat_template(llm, hf_smol, hf_reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (output,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16))
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert output.prompt_token_ids == list(ids)
    assert output.outputs[0].token_ids == hf_reference(hf_smol, list(ids), 16)


def generate_chunked(smol_dir, prompts, **scheduling) -> list:
    with LLM(str(smol_dir), kv_cache_memory=64 * 2**20, enable_prefix_caching=False, **scheduling) as llm:
        outputs = llm.generate(prompts, GREEDY)
        assert llm.engine.num_blocks_held() == 0
    return outputs


def test_chunked_prefill_across_block_boundaries(smol_dir, mixed_prompts, hf_smol, hf_reference):
    prompts = [mixed_prompts[i] for i in (9, 11, 12)]  # 100, 257, 400 tokens
    # 37-token chunks never align with 16-token blocks; a 48-token budget mixes chunks and decodes.
    outputs = generate_chunked(smol_dir, prompts, max_prefill_chunk=37, max_num_batched_tokens=48)
    assert_matches_oracle(outputs, prompts, hf_smol, hf_reference, 12)


def test_prompts_beside_decoding_requests_go_in_capped_chunks(smol_dir, mixed_prompts, hf_smol, hf_reference):
    prompts = [mixed_prompts[i] for i in (8, 11, 12)]  # 64, 257, 400 tokens
    # Step 1 has no decodes (64 + 36 prompt tokens); from step 2 the first request decodes, and
    # max_decode_stall_s=0 holds every later step's prompt tokens to the 32-token floor.
    outputs = generate_chunked(smol_dir, prompts, max_num_batched_tokens=100, max_decode_stall_s=0.0)
    chunks = [[n for _start, _end, n in output.metrics.prefill_chunks] for output in outputs]
    assert chunks[0] == [64] and chunks[1] == [36, 32, 32, 32, 32, 32, 32, 29]
    # The third prompt starts in the 3 tokens left beside the second's last chunk; its last 45 come
    # once the other two have finished: with nothing decoding, no cap.
    assert chunks[2] == [3] + [32] * 11 + [45]
    assert_matches_oracle(outputs, prompts, hf_smol, hf_reference, 12)


def test_preemption_keeps_outputs_exact(smol_dir, mixed_prompts, hf_smol, hf_reference):
    prompts = [mixed_prompts[i] for i in (6, 7, 8, 9, 10)]  # 31..161 tokens
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2 float32: layers * K/V * block * kv heads * head dim * 4
    with LLM(str(smol_dir), kv_cache_memory=32 * block_bytes) as llm:  # 512 token slots for ~580 needed
        outputs = llm.generate(prompts, params)
        assert llm.engine.num_preemptions > 0, "the cache was meant to be too small for all requests at once"
        assert llm.engine.num_blocks_held() == 0
        llm.engine.check_integrity()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_reference(hf_smol, prompt, 40)[: len(output.outputs[0].token_ids)]
        assert len(output.outputs[0].token_ids) == 40


def test_tensor_parallel_3_smollm2(smol_dir, mixed_prompts, hf_smol, hf_reference):
    prompts = [mixed_prompts[i] for i in (0, 5, 10)] + [PROMPTS[0]]
    with LLM(str(smol_dir), tensor_parallel_size=3, kv_cache_memory=32 * 2**20) as llm:
        outputs = llm.generate(prompts, GREEDY)
        assert llm.engine.num_blocks_held() == 0
    ids = [p if isinstance(p, list) else llm.tokenizer.encode(p) for p in prompts]
    assert_matches_oracle(outputs, ids, hf_smol, hf_reference, 12)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tiny_llama_any_tp(tp, tiny_dir, hf_tiny, hf_reference):
    prompts = [[5 + i for i in range(n)] for n in (1, 9, 40, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(str(tiny_dir), tensor_parallel_size=tp, kv_cache_memory=8 * 2**20) as llm:
        outputs = llm.generate(prompts, params)
        assert llm.engine.num_blocks_held() == 0
    assert_matches_oracle(outputs, prompts, hf_tiny, hf_reference, 16)


def test_eager_and_compiled_paths_give_the_same_tokens(llm, smol_dir, mixed_prompts, hf_smol, hf_reference):
    """``compile: false`` (plain torch ops, eager: what CUDA and a machine without a C compiler
    run) against the compiled CPU kernels (the default): the same float32 tokens, transformers'."""
    from engine.cpu_kernels import cpu_kernels

    prompts = mixed_prompts[::3]
    with LLM(str(smol_dir), kv_cache_memory=128 * 2**20, compile=False) as eager:
        assert eager.engine.executor.driver.model.model.kernels is None
        assert not eager.engine.executor.driver.backend.cpu_kernels
        eager_outputs = eager.generate(prompts, GREEDY)
    assert (llm.engine.executor.driver.model.model.kernels is not None) == (cpu_kernels() is not None)
    compiled_outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in eager_outputs] == [o.outputs[0].token_ids for o in compiled_outputs]
    assert_matches_oracle(eager_outputs, prompts, hf_smol, hf_reference, 12)
