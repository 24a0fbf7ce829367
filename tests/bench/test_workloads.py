"""Workload generation (bench.workloads) and trace replay (bench.traces): seeded statistics, no server."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench import workloads
from bench.traces import TraceRequest, read_trace, write_trace
from bench.workloads import CHATBOT, CODE, SUMMARIZATION, LogNormalLengths, build_workload, make_prompt
from common.errors import ConfigError

N = 20_000


class CharTokenizer:
    """One token per character: exact, so prompt lengths can be checked without a model."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def _gaps(arrivals: np.ndarray) -> np.ndarray:
    return np.diff(arrivals)


# ---------------------------------------------------------------- arrivals
def test_poisson_mean_and_cv():
    arrivals = workloads.poisson(4.0, N, np.random.default_rng(0))
    gaps = _gaps(arrivals)
    assert len(arrivals) == N and arrivals[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_mean_and_cv(burstiness):
    gaps = _gaps(workloads.gamma(2.0, N, burstiness, np.random.default_rng(1)))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(math.sqrt(burstiness), rel=0.08)


def test_constant_is_evenly_spaced():
    gaps = _gaps(workloads.constant(5.0, 100))
    assert np.allclose(gaps, 0.2)


def test_infinite_rate_sends_everything_at_once():
    assert not workloads.poisson(math.inf, 10, np.random.default_rng(0)).any()
    assert not workloads.constant(math.inf, 10).any()


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_bad_rate_is_refused(rate):
    with pytest.raises(ConfigError, match="rate"):
        workloads.poisson(rate, 10, np.random.default_rng(0))


def test_unknown_arrival_process():
    with pytest.raises(ConfigError, match="poisson"):
        build_workload("chatbot", 1.0, 10, arrival="bursty")


# ---------------------------------------------------------------- lengths
@pytest.mark.parametrize(
    ("sampler", "dist"),
    [(workloads.chatbot, CHATBOT), (workloads.code, CODE), (workloads.summarization, SUMMARIZATION)],
)
def test_named_length_distributions_match_their_parameters(sampler, dist: LogNormalLengths):
    prompt, output = sampler(N, np.random.default_rng(2), max_model_len=10**9)
    assert prompt.mean() == pytest.approx(dist.prompt_mean, rel=0.05)
    assert output.mean() == pytest.approx(dist.output_mean, rel=0.05)
    assert np.median(prompt) == pytest.approx(dist.median(dist.prompt_mean, dist.prompt_sigma), rel=0.05)
    assert np.median(output) == pytest.approx(dist.median(dist.output_mean, dist.output_sigma), rel=0.05)


@pytest.mark.parametrize("name", ["chatbot", "code", "summarization", "mixed"])
@pytest.mark.parametrize("max_model_len", [16, 512, 2048])
def test_lengths_respect_the_context(name, max_model_len):
    prompt, output = workloads.WORKLOADS[name](N, np.random.default_rng(3), max_model_len=max_model_len)
    assert prompt.min() >= 1 and output.min() >= 1
    assert (prompt + output).max() <= max_model_len


def test_scale_shrinks_lengths():
    full = workloads.chatbot(N, np.random.default_rng(4), max_model_len=10**9)
    tenth = workloads.chatbot(N, np.random.default_rng(4), max_model_len=10**9, scale=0.1)
    assert tenth[0].mean() == pytest.approx(full[0].mean() * 0.1, rel=0.02)
    assert tenth[1].mean() == pytest.approx(full[1].mean() * 0.1, rel=0.02)


def test_over_long_requests_lose_prompt_not_output():
    prompt, output = workloads.fixed(3000, 100, 3, max_model_len=2048)
    assert list(prompt) == [1948] * 3 and list(output) == [100] * 3


def test_uniform_and_fixed_specs():
    requests = build_workload("uniform:10,20,3,5", 1.0, 500)
    assert {r.num_prompt_tokens for r in requests} == set(range(10, 21))
    assert {r.num_output_tokens for r in requests} == {3, 4, 5}
    requests = build_workload("fixed:8,4", 1.0, 5)
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in requests] == [(8, 4)] * 5


@pytest.mark.parametrize("name", ["nope", "fixed:8", "uniform:1,2,3", "fixed:a,b"])
def test_unknown_workload_names_the_known_ones(name):
    with pytest.raises(ConfigError, match="chatbot, code, summarization"):
        build_workload(name, 1.0, 5)


# ---------------------------------------------------------------- workloads and prompts
def test_same_seed_same_workload_different_seed_different():
    tokenizer = CharTokenizer()
    a = build_workload("chatbot", 2.0, 50, seed=7, scale=0.1, tokenizer=tokenizer)
    b = build_workload("chatbot", 2.0, 50, seed=7, scale=0.1, tokenizer=tokenizer)
    c = build_workload("chatbot", 2.0, 50, seed=8, scale=0.1, tokenizer=tokenizer)
    assert a == b
    assert a != c
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)


def test_without_a_tokenizer_prompts_are_empty():
    requests = build_workload("code", 1.0, 20, arrival="gamma", burstiness=2.0)
    assert len(requests) == 20 and all(r.prompt == "" for r in requests)


@pytest.mark.parametrize("corpus", ["prose", "code"])
def test_make_prompt_exact_with_a_char_tokenizer(corpus):
    tokenizer = CharTokenizer()
    for num_tokens in (1, 7, 300, 5000):  # 5000: longer than the corpus, so it repeats
        assert len(make_prompt(tokenizer, num_tokens, seed=num_tokens, corpus=corpus)) == num_tokens
    assert make_prompt(tokenizer, 50, 1) == make_prompt(tokenizer, 50, 1) != make_prompt(tokenizer, 50, 2)


def test_workload_prompts_have_their_lengths():
    requests = build_workload("code", 1.0, 30, scale=0.5, tokenizer=CharTokenizer())
    assert all(len(r.prompt) == r.num_prompt_tokens for r in requests)


def test_make_prompt_with_the_real_tokenizer():
    from common import env
    from engine.model_loader import DEFAULT_MODEL_NAME

    model_dir = env.cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (model_dir / "config.json").exists():
        pytest.skip("the default model is not converted yet (the slow tests convert it once)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    errors = []
    for corpus in ("prose", "code"):
        for seed, num_tokens in enumerate((1, 2, 13, 64, 257, 1000)):
            prompt = make_prompt(tokenizer, num_tokens, seed, corpus=corpus)
            errors.append(len(tokenizer.encode(prompt, add_special_tokens=False)) - num_tokens)
    assert all(abs(e) <= 2 for e in errors), errors


# ---------------------------------------------------------------- traces
TRACE_FORMATS = {
    "mooncake": [
        {"timestamp": 1000, "input_length": 100, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 200, "output_length": 20, "hash_ids": [3]},
        {"timestamp": 3000, "input_length": 300, "output_length": 30, "hash_ids": []},
    ],
    "azure_iso": [
        {"TIMESTAMP": "2023-11-16 18:15:46.0000000", "ContextTokens": 100, "GeneratedTokens": 10},
        {"TIMESTAMP": "2023-11-16 18:15:46.5000000", "ContextTokens": 200, "GeneratedTokens": 20},
        {"TIMESTAMP": "2023-11-16 18:15:48.0000000", "ContextTokens": 300, "GeneratedTokens": 30},
    ],
    "azure_seconds": [
        {"TIMESTAMP": 12.0, "ContextTokens": 100, "GeneratedTokens": 10},
        {"TIMESTAMP": 12.5, "ContextTokens": 200, "GeneratedTokens": 20},
        {"TIMESTAMP": 14.0, "ContextTokens": 300, "GeneratedTokens": 30},
    ],
    "pdserve": [
        {"arrival_s": 5.0, "num_prompt_tokens": 100, "num_output_tokens": 10},
        {"arrival_s": 5.5, "num_prompt_tokens": 200, "num_output_tokens": 20},
        {"arrival_s": 7.0, "num_prompt_tokens": 300, "num_output_tokens": 30},
    ],
}
EXPECTED = [TraceRequest(0.0, 100, 10), TraceRequest(0.5, 200, 20), TraceRequest(2.0, 300, 30)]


@pytest.mark.parametrize("fmt", sorted(TRACE_FORMATS))
def test_read_trace_formats(tmp_path, fmt):
    rows = TRACE_FORMATS[fmt]
    path = tmp_path / "trace.jsonl"
    # Out of order, with a comment and a blank line: the reader sorts and skips them.
    path.write_text("# a trace\n" + "\n".join(json.dumps(r) for r in [rows[2], rows[0], rows[1]]) + "\n\n")
    assert read_trace(path) == EXPECTED
    assert read_trace(path, time_scale=2.0) == [TraceRequest(r.arrival_s / 2, *_lengths(r)) for r in EXPECTED]
    assert read_trace(path, max_requests=2) == EXPECTED[:2]


def _lengths(r: TraceRequest) -> tuple[int, int]:
    return r.num_prompt_tokens, r.num_output_tokens


def test_read_azure_csv(tmp_path):
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0000000,100,10\n2023-11-16 18:15:46.5000000,200,20\n2023-11-16 18:15:48.0000000,300,30\n"
    )
    assert read_trace(path) == EXPECTED


def test_write_then_read_roundtrip(tmp_path):
    assert read_trace(write_trace(tmp_path / "t.jsonl", EXPECTED)) == EXPECTED


def test_bad_traces(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"time": 1, "input": 2}\n')
    with pytest.raises(ConfigError, match="no known timestamp field"):
        read_trace(path)
    path.write_text('{"timestamp": 1, "input_length": 2}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1"):
        read_trace(path)
    path.write_text("not json\n")
    with pytest.raises(ConfigError, match="JSON"):
        read_trace(path)
    with pytest.raises(ConfigError, match="does not exist"):
        read_trace(tmp_path / "missing.jsonl")


def test_trace_workload(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", EXPECTED)
    recorded = build_workload(f"trace:{path}", None, 100)
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in recorded] == [
        (0.0, 100, 10),
        (0.5, 200, 20),
        (2.0, 300, 30),
    ]
    faster = build_workload(f"trace:{path}", 4.0, 100, max_model_len=256, scale=0.5, tokenizer=CharTokenizer())
    assert faster[-1].arrival_s == pytest.approx(0.5)  # 2 gaps at an average 4 requests/s
    assert faster[1].arrival_s == pytest.approx(0.125)  # the trace's shape is kept
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in faster] == [(50, 5), (100, 10), (150, 15)]
    assert all(len(r.prompt) == r.num_prompt_tokens for r in faster)
    assert len(build_workload(f"trace:{path}", None, 2)) == 2


# ---------------------------------------------------------------- multi-turn chat
def test_multiturn_conversations_share_system_prompts_and_grow_turn_by_turn():
    tokenizer = CharTokenizer()
    requests = build_workload("multiturn:2,3,40", 4.0, 30, seed=3, tokenizer=tokenizer)
    assert len(requests) == 30 and [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert all(r.num_prompt_tokens == len(r.prompt) and r.num_output_tokens == 48 for r in requests)
    systems = {r.prompt.split("\nUser:")[0] for r in requests}
    assert len(systems) == 2  # every conversation opens with one of two shared system prompts
    # Each turn after a conversation's first extends an earlier prompt: that prompt is its prefix.
    first_turns = [r for r in requests if r.prompt.count("\nUser:") == 1]
    later = [r for r in requests if r.prompt.count("\nUser:") > 1]
    assert len(first_turns) == 10 and len(later) == 20
    for request in later:
        assert any(request.prompt.startswith(o.prompt) and o.arrival_s < request.arrival_s for o in requests)
    # Turns arrive at the requested rate on average (conversations at rate / turns): over a long
    # run, the last conversation's trailing turns barely count.
    many = build_workload("multiturn:2,3,40", 4.0, 3000, seed=3)
    assert 3.6 < 2999 / (many[-1].arrival_s - many[0].arrival_s) < 4.4


def test_multiturn_without_a_tokenizer_gives_lengths_and_refuses_bad_shapes():
    requests = build_workload("multiturn", 1.0, 8, seed=0)
    assert {r.num_prompt_tokens for r in requests} <= {304, 400, 496, 592}  # 256 + 48, then + 96 a turn
    assert all(r.prompt == "" for r in requests)
    for name in ("multiturn:0,2", "multiturn:2", "multiturn:a,b"):
        with pytest.raises(ConfigError, match="multiturn:SYSTEM_PROMPTS,TURNS"):
            build_workload(name, 1.0, 4)


def test_the_mixed_workload_is_mostly_short_prompts_with_a_quarter_long_ones():
    from bench.workloads import MIXED_LONG_PROMPT, MIXED_SHORT_PROMPT, mixed

    prompt, output = mixed(4000, np.random.default_rng(0), max_model_len=4096)
    is_long = prompt >= MIXED_LONG_PROMPT[0]
    assert 0.22 < is_long.mean() < 0.28
    assert prompt[~is_long].max() <= MIXED_SHORT_PROMPT[1] and prompt[is_long].max() <= MIXED_LONG_PROMPT[1]
    assert output.min() >= 32 and output.max() <= 128


def test_goodput_configurations_pass_router_options_through_set():
    from bench.goodput import Configuration

    config = Configuration.parse("cd:mode=disagg,conditional_disaggregation=true,prefill_cores=1")
    assert config.serve_args([]) == [
        "--mode",
        "disagg",
        "--set",
        "router.conditional_disaggregation=true",
        "--prefill-cores",
        "1",
    ]
    assert config.spec().mode == "disagg"
    # A disaggregated configuration that does not say is DistServe's: every prompt to the prefill pool.
    pure = Configuration.parse("pure:mode=disagg,prefill_cores=1")
    assert pure.serve_args(["--port", "0"]) == [
        "--mode", "disagg", "--prefill-cores", "1", "--no-conditional-disaggregation", "--port", "0"
    ]  # fmt: skip
    assert "--no-conditional-disaggregation" not in Configuration.parse("c:mode=colocated").serve_args([])
    # Without a mode it is the disaggregated cluster spec() models, not what serve's auto picks here.
    unnamed = Configuration.parse("u:conditional_disaggregation=true")
    assert unnamed.serve_args([])[:2] == ["--mode", "disagg"] and unnamed.spec().mode == "disagg"
