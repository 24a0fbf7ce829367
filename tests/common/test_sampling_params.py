from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param", "allowed"),
    [
        ({"n": 0}, "n", "must be an integer >= 1"),
        ({"n": 1.5}, "n", "must be an integer >= 1"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
        ({"priority": 2**31}, "priority", "priority must be an integer"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": 1.5}, "max_tokens", ">= 1"),
        ({"max_tokens": True}, "max_tokens", ">= 1"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"temperature": float("nan")}, "temperature", ">= 0"),
        ({"temperature": float("inf")}, "temperature", ">= 0"),
        ({"temperature": "1"}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.01}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "-1"),
        ({"top_k": 2.0}, "top_k", "-1"),
        ({"min_p": -0.01}, "min_p", "[0, 1]"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "> 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"presence_penalty": -2.01}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": 2.01}, "frequency_penalty", "[-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
        ({"logprobs": -1}, "logprobs", "[0, 20]"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"logprobs": 1.0}, "logprobs", "[0, 20]"),
        ({"stop": {"a": 1}}, "stop", "unknown stop type"),
        ({"stop": 7}, "stop", "unknown stop type"),
        ({"stop": ""}, "stop", "non-empty"),
        ({"stop": ["ok", ""]}, "stop", "non-empty"),
        ({"stop": ["ok", 3]}, "stop", "non-empty"),
        ({"stop": ["s"] * 17}, "stop", "at most 16 stop strings, got 17"),
        ({"stop": ["ok", "x" * 257]}, "stop", "at most 256 characters, got one of 257"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids", "at most 256 stop_token_ids"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids", ">= 0"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids", ">= 0"),
        ({"stop_token_ids": 5}, "stop_token_ids", ">= 0"),
        ({"seed": 1.5}, "seed", "integer"),
        ({"seed": "42"}, "seed", "integer"),
        ({"ignore_eos": 1}, "ignore_eos", "boolean"),
    ],
)
def test_invalid_values_name_the_param_and_range(kwargs: dict, param: str, allowed: str) -> None:
    with pytest.raises(InvalidRequestError) as exc_info:
        SamplingParams(**kwargs)
    assert exc_info.value.param == param
    assert allowed in exc_info.value.message
    assert exc_info.value.code == "invalid_request"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"temperature": 0},
        {"temperature": 2.5},
        {"top_p": 1},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 50},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"repetition_penalty": 1e-3},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": -5},
        {"seed": 2**70},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_float_fields_are_stored_as_float() -> None:
    params = SamplingParams(temperature=1, top_p=1, presence_penalty=-2)
    assert type(params.temperature) is float
    assert type(params.top_p) is float
    assert type(params.presence_penalty) is float


def test_stop_is_normalized_to_a_tuple() -> None:
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bb"]).stop == ("a", "bb")
    assert SamplingParams(stop=("x",)).stop == ("x",)
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    # Normalized params are hashable (tuples, not lists).
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop=("a",)))


def test_properties() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=5e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties
    assert SamplingParams().max_stop_len == 0
    assert SamplingParams(stop=["ab", "abcd", "x"]).max_stop_len == 4


def test_is_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # type: ignore[misc]


def test_dict_round_trip_uses_plain_types() -> None:
    params = SamplingParams(
        max_tokens=64,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=-0.4,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 7],
        ignore_eos=True,
        logprobs=3,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    data = params.to_dict()
    assert data["stop"] == ["\n\n", "END"]
    assert data["stop_token_ids"] == [2, 7]
    # Survives a text serialization (msgpack carries the same plain types).
    restored = SamplingParams.from_dict(json.loads(json.dumps(data)))
    assert restored == params
    assert SamplingParams.from_dict(SamplingParams().to_dict()) == SamplingParams()


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(InvalidRequestError) as exc_info:
        SamplingParams.from_dict({"temperature": 0.5, "best_of": 2})
    assert exc_info.value.param == "best_of"


def test_module_does_not_import_torch() -> None:
    # common/ must stay importable in torch-free processes (router, frontends); check in a fresh
    # interpreter because other tests in this session may already have imported torch.
    repo_root = Path(__file__).resolve().parents[2]
    code = "import sys, common.sampling_params; sys.exit('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=repo_root,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
    )
    assert result.returncode == 0


def test_each_choice_of_n_draws_its_own_seed_stream():
    params = SamplingParams(n=3, seed=7, temperature=0.8)
    assert [(c.n, c.seed) for c in map(params.for_choice, range(3))] == [(1, 7), (1, 8), (1, 9)]
    assert SamplingParams(n=2).for_choice(1).seed is None
    assert SamplingParams.from_dict(SamplingParams(prompt_logprobs=2, priority=-1).to_dict()).priority == -1
