"""The correctness oracle: transformers' own model and its greedy decoding of one unpadded prompt.

The tests compare pdserve against it on CPU, and ``bench.cuda_check`` on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_hf(model_dir: Path, dtype: Any = None, device: Any = "cpu") -> Any:
    """transformers' model from ``model_dir`` (float32 unless ``dtype``), in eval mode on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or torch.float32).to(device)
    model.eval()
    return model


def hf_prompt_logprobs(model: Any, prompt_ids: list[int], num_top: int = 0) -> list[tuple[float, list[int]]]:
    """transformers' score of each prompt token after the first: (its logprob given the tokens
    before it, the ids of the ``num_top`` likeliest tokens there), from log_softmax of the logits."""
    import torch

    ids = torch.tensor([prompt_ids], device=next(model.parameters()).device)
    with torch.inference_mode():
        logprobs = model(ids).logits[0, :-1].float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).tolist()
    top = logprobs.topk(num_top, dim=-1).indices.tolist() if num_top else [[] for _ in chosen]
    return list(zip(chosen, top, strict=True))


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int, **constraints: Any) -> list[int]:
    """transformers' greedy decoding of ``prompt_ids``, on the model's device: the new token ids.
    ``constraints``: generate's own (``min_new_tokens``, ``sequence_bias``), for the oracle of ours."""
    import torch

    ids = torch.tensor([prompt_ids], device=next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            **constraints,
        )
    return out[0, len(prompt_ids) :].tolist()
