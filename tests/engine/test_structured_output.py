"""Constrained decoding in the engine: the token mask as xgrammar's own kernel applies it; greedy
output under a constraint equals transformers' generate with xgrammar's logits processor, token for
token; constraints hold whatever the weights (a random-weight model of the real shape), greedy and
sampled; a request waits for its grammar holding no blocks, a compile that fails ends it, a dead
end stops it, and the compile cache is bounded."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import pytest
import torch

from common.sampling_params import SamplingParams
from common.structured_outputs import ConstraintKind, StructuredOutput, schema_depth
from engine import LLM
from engine.structured_output import apply_token_bitmask

xgr = pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "admin", "tags", "address"],
    "additionalProperties": False,
}
DATE = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
ARITHMETIC = 'root ::= expr\nexpr ::= term (("+" | "-") term){0,3}\nterm ::= [1-9] [0-9]{0,2}'


def json_constraint(schema: dict) -> StructuredOutput:
    return StructuredOutput(ConstraintKind.JSON, json.dumps(schema))


CONSTRAINTS = [
    (json_constraint(PERSON), lambda text: jsonschema.validate(json.loads(text), PERSON)),
    (StructuredOutput(ConstraintKind.REGEX, DATE), lambda text: _fullmatch(DATE, text)),
    (StructuredOutput(ConstraintKind.CHOICE, json.dumps(["red", "green", 'blue "navy"'])), None),
    (
        StructuredOutput(ConstraintKind.GRAMMAR, ARITHMETIC),
        lambda text: _fullmatch(r"[1-9]\d{0,2}([+-][1-9]\d{0,2}){0,3}", text),
    ),
]


def _fullmatch(pattern: str, text: str) -> None:
    assert re.fullmatch(pattern, text), text


def _check(constraint: StructuredOutput, check, text: str) -> None:
    if constraint.kind is ConstraintKind.CHOICE:
        assert text in json.loads(constraint.spec), text
    else:
        check(text)


@pytest.mark.parametrize("vocab_size", [49152, 49150, 1000])
def test_the_mask_is_applied_as_xgrammar_s_kernel_applies_it(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    words = (vocab_size + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=generator)
    logits = torch.randn(6, vocab_size, generator=generator)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 4], [5]):
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask, indices=rows)
        got = logits.clone()
        every = len(rows) == 6
        apply_token_bitmask(got, bitmask[rows].contiguous(), None if every else torch.tensor(rows))
        assert torch.equal(got, want), rows
        untouched = [i for i in range(6) if i not in rows]
        assert torch.equal(got[untouched], logits[untouched])


def test_schema_depth_counts_nesting_and_stops_past_the_limit():
    assert schema_depth({"a": [1, {"b": 2}]}, 10) == 3
    deep: dict = {}
    for _ in range(100):
        deep = {"x": deep}
    assert schema_depth(deep, 5) == 6


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    with LLM(str(tiny_dir), kv_cache_memory=64 * 2**20) as instance:
        yield instance
        assert instance.engine.num_blocks_held() == 0


@pytest.fixture(scope="module")
def tiny_compiler(tiny_llm):
    info = xgr.TokenizerInfo.from_huggingface(tiny_llm.tokenizer, vocab_size=tiny_llm.engine.vocab_size)
    return xgr.GrammarCompiler(info)


def test_constrained_greedy_equals_transformers_with_xgrammar_s_logits_processor(tiny_llm, tiny_compiler, hf_tiny):
    """The oracle: transformers' greedy generate, masked by xgrammar's own HF logits processor."""
    from xgrammar.contrib.hf import LogitsProcessor

    from bench.oracle import hf_greedy

    prompt = tiny_llm.tokenizer.encode("Write the answer:")
    for constraint, _ in CONSTRAINTS:
        (ours,) = tiny_llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=48, structured_output=constraint)
        )
        processor = LogitsProcessor(tiny_compiler.compile_grammar(constraint.grammar()))
        want = hf_greedy(hf_tiny, prompt, 48, logits_processor=[processor])
        assert ours.outputs[0].token_ids == want, constraint.kind


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_constraints_hold_whatever_the_weights_greedy_and_sampled(tiny_llm, seed):
    """A random-weight model left to itself writes noise: every output still fits its constraint
    (the budget is large enough for each to complete)."""
    prompts = [tiny_llm.tokenizer.encode(text) for text in ("Hello", "A list:", "x" * 5)]
    temperature = 0.0 if seed is None else 1.3
    batch = [(prompt, constraint, check) for prompt in prompts for constraint, check in CONSTRAINTS]
    params = [
        SamplingParams(temperature=temperature, seed=seed, max_tokens=160, structured_output=c) for _, c, _ in batch
    ]
    outputs = tiny_llm.generate([p for p, _, _ in batch], params)
    for (_, constraint, check), output in zip(batch, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (constraint.kind, completion.text)
        try:
            _check(constraint, check, completion.text)
        except Exception as exc:
            raise AssertionError(f"{constraint.kind}: {completion.text!r} {completion.token_ids}") from exc


def test_a_dead_end_stops_the_request_with_its_text_whole(tiny_llm):
    """min_tokens holds EOS back, but after "yes" the grammar allows nothing else: every token is
    masked, the sampled one is refused and taken back, and the request stops with "yes"."""
    choice = StructuredOutput(ConstraintKind.CHOICE, json.dumps(["yes"]))
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=8, logprobs=0, structured_output=choice)
    (output,) = tiny_llm.generate([tiny_llm.tokenizer.encode("Say yes")], params)
    completion = output.outputs[0]
    assert (completion.text, completion.finish_reason) == ("yes", "stop")
    assert len(completion.logprobs) == len(completion.token_ids)
    # ignore_eos: the grammar completes and the request may not end by EOS: it stops there too.
    ignoring = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, structured_output=choice)
    (output,) = tiny_llm.generate([tiny_llm.tokenizer.encode("Say yes")], ignoring)
    assert output.outputs[0].text.startswith("yes") and output.outputs[0].finish_reason == "stop"
    assert len(output.outputs[0].token_ids) < 16


def test_a_request_waits_for_its_grammar_holding_no_blocks_and_a_failed_compile_ends_it(tiny_llm, monkeypatch):
    engine = tiny_llm.engine
    pending: concurrent.futures.Future = concurrent.futures.Future()
    monkeypatch.setattr(engine.grammars.compilers, "submit", lambda constraint: pending)
    constraint = StructuredOutput(ConstraintKind.REGEX, "[a-z]{3}")
    prompt = tiny_llm.tokenizer.encode("a prompt of a few tokens")
    engine.add_request("waits", prompt, SamplingParams(temperature=0, max_tokens=4, structured_output=constraint))
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=4))
    free_done = False
    for _ in range(8):  # the unconstrained request runs to its end meanwhile
        free_done |= any(out.finished and out.request_id == "free" for out in engine.step())
        assert "waits" not in engine.kv.req_blocks  # no block taken while compiling
    assert free_done and engine.has_unfinished_requests()
    pending.set_exception(RuntimeError("compiler exploded"))
    outputs = [out for _ in range(3) for out in engine.step()]
    (ended,) = [out for out in outputs if out.request_id == "waits"]
    assert ended.finished and "compiler exploded" in ended.error
    assert not engine.has_unfinished_requests() and engine.num_blocks_held() == 0 and not len(engine.grammars)


def test_the_compile_cache_shares_a_constraint_and_forgets_the_least_recently_used(tiny_llm):
    from engine.structured_output import GrammarCompilerPool

    pool = GrammarCompilerPool(tiny_llm.tokenizer, tiny_llm.engine.vocab_size, cache_size=2)
    regexes = [StructuredOutput(ConstraintKind.REGEX, f"a{{{i}}}") for i in (1, 2, 3)]
    first = pool.submit(regexes[0])
    assert pool.submit(regexes[0]) is first and (pool.stats.num_hits, pool.stats.num_misses) == (1, 1)
    pool.submit(regexes[1]).result()
    pool.submit(regexes[2]).result()
    assert pool.cache_size == 2 and pool.submit(regexes[0]) is not first  # compiled again
    assert pool.stats.num_misses == 4 and len(pool.stats.take_compile_seconds()) >= 3
    pool.shutdown()


def test_offline_api_refuses_a_constraint_that_does_not_compile(tiny_llm):
    from common.errors import InvalidRequestError

    bad = StructuredOutput(ConstraintKind.REGEX, "(unclosed")
    with pytest.raises(InvalidRequestError, match="does not compile") as refused:
        tiny_llm.generate(["hi"], SamplingParams(max_tokens=4, structured_output=bad))
    assert refused.value.param == "structured_outputs.regex"
    assert tiny_llm.engine.num_blocks_held() == 0


def test_the_constraint_crosses_processes_as_plain_types():
    params = SamplingParams(structured_output=json_constraint(PERSON))
    wire = params.to_dict()
    assert wire["structured_output"] == {"kind": "json", "spec": json.dumps(PERSON), "any_whitespace": False}
    assert SamplingParams.from_dict(json.loads(json.dumps(wire))) == params


def test_json_masks_keep_control_characters_out_of_bounded_strings(tiny_llm):
    """xgrammar 0.2.9 lets a string with a maxLength hold raw control characters; the JSON filter
    bans them (compact JSON) or all but tab, newline and carriage return (free whitespace)."""
    from engine.structured_output import GrammarCompilerPool

    pool = GrammarCompilerPool(tiny_llm.tokenizer, tiny_llm.engine.vocab_size)
    bounded = json_constraint({"type": "string", "maxLength": 10})
    pool.submit(bounded).result()
    nul, newline = 190, tiny_llm.tokenizer.convert_tokens_to_ids("Ċ")  # byte-level BPE's \x00 and \n
    assert tiny_llm.tokenizer.decode([nul]) == "\x00" and tiny_llm.tokenizer.decode([newline]) == "\n"

    def allowed(words: torch.Tensor, token: int) -> bool:
        return bool((int(words[token // 32]) >> (token % 32)) & 1)

    compact = pool.json_filter(bounded)
    loose = pool.json_filter(StructuredOutput(ConstraintKind.JSON, bounded.spec, any_whitespace=True))
    letter = tiny_llm.tokenizer.convert_tokens_to_ids("a")
    assert not allowed(compact, nul) and not allowed(compact, newline) and allowed(compact, letter)
    assert not allowed(loose, nul) and allowed(loose, newline)
    assert pool.json_filter(StructuredOutput(ConstraintKind.REGEX, "a")) is None
    pool.shutdown()
