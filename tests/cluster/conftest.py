"""Fixtures the cluster drills share."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture(scope="module")
def greedy_text(smol_dir, hf_smol, hf_reference) -> Callable[[str, int], str]:
    """transformers' greedy continuation of a prompt, ``max_tokens`` tokens, as text (the oracle)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smol_dir))

    def get(prompt: str, max_tokens: int) -> str:
        ids = hf_reference(hf_smol, tokenizer.encode(prompt), max_tokens)
        return tokenizer.decode(ids, skip_special_tokens=True)

    return get
