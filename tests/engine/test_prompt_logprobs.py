"""prompt_logprobs and n > 1 on the real model, offline.

The oracle is transformers: each prompt token's logprob is log_softmax of its logits in float32,
within 1e-4, whether the prompt is computed in one step or in chunks, and whether its blocks are
in the prefix cache or not (a scored prompt is computed whole). Choices of an ``n > 1`` request
get the prompt's blocks from the prefix cache, and their own seed streams.
"""

from __future__ import annotations

import pytest

from bench.oracle import hf_prompt_logprobs
from engine import LLM, SamplingParams
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def llm(smol_dir):
    # Chunks of 16: a prompt of 40 tokens is scored over three steps.
    with LLM(str(smol_dir), kv_cache_memory=128 * 2**20, max_prefill_chunk=16) as instance:
        yield instance
        assert instance.engine.num_blocks_held() == 0


def _check_against_transformers(output, prompt, hf_smol, num_top):
    expected = hf_prompt_logprobs(hf_smol, prompt, num_top)
    scores = output.prompt_logprobs
    assert scores is not None and len(scores) == len(prompt) - 1
    for position, (score, (logprob, top_ids)) in enumerate(zip(scores, expected, strict=True), start=1):
        assert score.token_id == prompt[position]
        assert abs(score.logprob - logprob) < TOLERANCE, (position, score.logprob, logprob)
        assert [token_id for token_id, _ in score.top] == top_ids


def test_prompt_logprobs_equal_transformers_in_one_step_and_in_chunks(llm, hf_smol):
    short = llm.tokenizer.encode(PROMPTS[0])
    long = llm.tokenizer.encode(" ".join(PROMPTS * 2))
    assert len(short) < 16 < 32 < len(long)
    for prompt, num_top in ((short, 0), (long, 5)):
        (output,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=num_top))
        _check_against_transformers(output, prompt, hf_smol, num_top)


def test_a_cached_prompt_is_scored_whole(llm, hf_smol):
    prompt = llm.tokenizer.encode(" ".join(PROMPTS[1:3]))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # its blocks are now cached
    (again,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    assert again.num_cached_tokens > 0
    (scored,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    assert scored.num_cached_tokens == 0
    _check_against_transformers(scored, prompt, hf_smol, 2)


def test_without_prompt_logprobs_none_are_returned(llm):
    (output,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2))
    assert output.prompt_logprobs is None


def test_n_choices_share_the_prompts_blocks_and_draw_their_own_seed_streams(llm):
    prompt = llm.tokenizer.encode(" ".join(PROMPTS[2:] + PROMPTS[:2]))
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=3)
    salt = "n-choices"  # a prompt no other test cached
    hits_before = llm.engine.stats().kv.num_hit_tokens
    (first,) = llm.generate([prompt], params, cache_salt=salt)
    shared = llm.engine.stats().kv.num_hit_tokens - hits_before
    (second,) = llm.generate([prompt], params, cache_salt=salt)
    texts = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert texts == [c.token_ids for c in second.outputs]  # reproducible
    assert len({tuple(t) for t in texts}) == 3  # each its own stream
    # The first choice computed the prompt; the others took its full blocks from the prefix cache.
    full_blocks = len(prompt) // 16 * 16
    assert first.num_cached_tokens == 0 and full_blocks >= 16
    assert shared == 2 * full_blocks
    assert llm.engine.num_blocks_held() == 0
    # Choice i is the request of seed 7 + i: the same tokens alone.
    (alone,) = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=12, seed=8))
    assert alone.outputs[0].token_ids == texts[1]


def test_the_engine_refuses_n_above_one_by_name(llm):
    from common.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as refused:
        llm.engine.add_request("many", [1, 2, 3], SamplingParams(n=2))
    assert refused.value.param == "n"
