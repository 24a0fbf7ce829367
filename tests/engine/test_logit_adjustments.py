"""min_tokens and logit_bias on the real model: greedy output equals transformers' generate with
``min_new_tokens`` and ``sequence_bias``, token for token, in float32."""

from __future__ import annotations

import pytest

from bench.oracle import hf_greedy
from engine import LLM, SamplingParams
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow

QUESTION = "What is 2+2? Answer with a number only."  # greedy: "2 + 2 = 4" then EOS, 8 tokens


@pytest.fixture(scope="module")
def llm(smol_dir):
    with LLM(str(smol_dir), kv_cache_memory=128 * 2**20) as instance:
        yield instance
        assert instance.engine.num_blocks_held() == 0


# transformers' greedy decoding under its own constraints (its stop on EOS included).
hf_generate = hf_greedy


def test_min_tokens_holds_eos_back_as_transformers_min_new_tokens(llm, hf_smol):
    chat = [{"role": "user", "content": QUESTION}]
    prompt = list(llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    eos = hf_smol.generation_config.eos_token_id
    (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
    assert plain.outputs[0].finish_reason == "stop" and len(plain.outputs[0].token_ids) < 12  # ends early alone
    for min_tokens in (12, 24):
        (held,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, min_tokens=min_tokens))
        expected = hf_generate(hf_smol, prompt, 24, min_new_tokens=min_tokens)
        tokens = held.outputs[0].token_ids
        assert tokens == expected and len(tokens) >= min_tokens and eos not in tokens[:min_tokens]
    # Stop strings wait for min_tokens too (vLLM's rule): "=" comes at the 4th token, well before 12.
    (stopped,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, min_tokens=12, stop=["="]))
    assert len(stopped.outputs[0].token_ids) >= 12


def test_logit_bias_bans_and_forces_tokens_as_transformers_sequence_bias(llm, hf_smol):
    prompt = llm.tokenizer.encode(PROMPTS[0])
    (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    first, third = plain.outputs[0].token_ids[0], plain.outputs[0].token_ids[2]
    forced = llm.tokenizer.encode(" lighthouse")[0]
    for bias in ({first: -100.0, third: -100.0}, {forced: 100.0}, {first: -3.5, forced: 2.25}):
        (biased,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logit_bias=bias))
        expected = hf_generate(hf_smol, prompt, 8, sequence_bias={(token,): value for token, value in bias.items()})
        assert biased.outputs[0].token_ids == expected, bias
    (banned,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logit_bias={first: -100.0}))
    assert banned.outputs[0].token_ids[0] != first
    (forcing,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logit_bias={forced: 100.0}))
    assert forcing.outputs[0].token_ids == [forced] * 8


def test_a_bias_on_a_token_past_the_vocabulary_is_refused_by_name(llm):
    from common.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(["hi"], SamplingParams(logit_bias={llm.engine.vocab_size: 1.0}))
    assert refused.value.param == "logit_bias"
