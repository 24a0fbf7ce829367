"""The model's generation_config.json gives the sampling defaults a request leaves out, never over
a value it sent (vLLM's --generation-config auto)."""

from __future__ import annotations

import json

from common.generation_config import sampling_defaults
from common.sampling_params import SamplingParams
from router.protocol import parse_request

MODEL = "m"


def test_the_file_s_sampling_keys_become_request_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "max_new_tokens": 40,
                "do_sample": True,  # not a sampling value: vLLM does not read it either
                "eos_token_id": [1, 2],
                "min_p": "high",  # wrong type: left out with a warning, not every request refused
            }
        )
    )
    defaults = sampling_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 40}

    plain = parse_request({"model": MODEL, "prompt": "hi"}, MODEL, "completion", defaults)
    assert plain.sampling == SamplingParams(
        temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05, max_tokens=40
    )
    own = parse_request(
        {"model": MODEL, "prompt": "hi", "temperature": 0, "top_k": None, "max_tokens": 3},
        MODEL,
        "completion",
        defaults,
    )
    assert (own.sampling.temperature, own.sampling.top_k, own.sampling.max_tokens) == (0.0, 20, 3)
    chat = parse_request({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, MODEL, "chat", defaults)
    assert (chat.sampling.temperature, chat.sampling.max_tokens) == (0.6, 40)


def test_no_file_or_an_unreadable_one_gives_no_defaults(tmp_path):
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}
