"""Prompt logprobs: each prompt token's log-probability given the tokens before it (vLLM's
``prompt_logprobs``; lm-eval's loglikelihood tasks read them through ``echo`` + ``logprobs``).

The step computes logits for the rows its chunks mark (``ScheduledChunk.num_prompt_logprobs``)
after the sampled rows; they are scored here from the RAW logits, as the sampler's logprobs are.
A prompt computed again after a preemption scores its positions again: the first score stands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from common.outputs import TokenLogprob
from engine.step_input import PromptLogprobRows


def score_prompts(
    logits: torch.Tensor,
    rows: Sequence[PromptLogprobRows],
    prompt_of: Callable[[str], tuple[list[int], int]],
) -> dict[str, list[tuple[int, TokenLogprob]]]:
    """Per request: (scored token's position, its logprob with the top alternatives), from
    ``logits`` [sum of the rows' counts, vocab]. ``prompt_of(request_id)``: its prompt token ids
    and how many alternatives it asks for."""
    asked = [prompt_of(row.request_id) for row in rows]
    targets: list[int] = []
    for row, (prompt, _) in zip(rows, asked, strict=True):
        targets.extend(prompt[row.first_position + 1 : row.first_position + 1 + row.count])
    logprobs = logits.log_softmax(dim=-1)
    target_ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
    chosen_values = logprobs.gather(1, target_ids.unsqueeze(1))
    ranks = ((logprobs > chosen_values).sum(dim=1) + 1).tolist()
    chosen = chosen_values.squeeze(1).tolist()
    num_top = min(max(num for _, num in asked), logprobs.shape[1])
    top_values, top_ids = (t.tolist() for t in logprobs.topk(num_top, dim=-1)) if num_top else ([], [])
    scored: dict[str, list[tuple[int, TokenLogprob]]] = {}
    offset = 0
    for row, (_, num_alternatives) in zip(rows, asked, strict=True):
        entries = scored.setdefault(row.request_id, [])
        for k in range(row.count):
            i = offset + k
            top = (
                tuple(zip(top_ids[i][:num_alternatives], top_values[i][:num_alternatives], strict=True))
                if num_top
                else ()
            )
            entries.append((row.first_position + 1 + k, TokenLogprob(targets[i], chosen[i], top, ranks[i])))
        offset += row.count
    return scored
