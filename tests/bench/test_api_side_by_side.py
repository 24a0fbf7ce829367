"""bench.api_side_by_side's verdict: equal answers are called equal, a moved rank or logprob is seen."""

from __future__ import annotations

import copy

from bench.api_side_by_side import compare

ANSWER = {
    "loglikelihood": {"tokens": ["A", " b"], "token_logprobs": [None, -1.0], "text": "A b"},
    "prompt_logprobs": [None, {"5": {"logprob": -1.0, "rank": 2, "decoded_token": " b"}}],
    "batch": [(0, " x"), (1, " y")],
    "chat_default_max_tokens": (37, "stop"),
}


def test_equal_answers_compare_equal_and_a_moved_rank_or_logprob_is_seen():
    verdict = compare(ANSWER, copy.deepcopy(ANSWER))
    assert verdict["echo_tokens_and_text_equal"] and verdict["prompt_logprobs_same_tokens_order_ranks"]
    assert verdict["echo_logprobs_max_abs_diff"] == 0.0 and verdict["greedy_batch_equal"]
    other = copy.deepcopy(ANSWER)
    other["prompt_logprobs"][1]["5"].update(rank=1, logprob=-1.25)
    other["loglikelihood"]["token_logprobs"][1] = -1.5
    verdict = compare(ANSWER, other)
    assert not verdict["prompt_logprobs_same_tokens_order_ranks"]
    assert verdict["prompt_logprobs_max_abs_diff"] == 0.25 and verdict["echo_logprobs_max_abs_diff"] == 0.5
