"""The offline benchmark's GEMM floor counts the attention pairs the engine's steps attend."""

from __future__ import annotations

import pytest

from bench.offline_throughput import decode_attended_pairs


@pytest.mark.parametrize(("prompt_lens", "lengths"), [([5], [1]), ([5], [4]), ([1, 256, 31], [64, 1, 7])])
def test_decode_pairs_are_what_each_decode_step_attends(prompt_lens, lengths):
    expected = 0
    for prompt_len, num_out in zip(prompt_lens, lengths, strict=True):
        context = prompt_len + 1  # prefill sampled the first token; a decode step feeds it back
        for _ in range(num_out - 1):
            expected += context  # the fed token attends to itself and every position before it
            context += 1
    assert decode_attended_pairs(prompt_lens, lengths) == expected
