"""Tokenizer loading and the model's end-of-sequence ids (from generation_config and the tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from common.tokenizer_files import generic_fast_tokenizer


def load_tokenizer(model_dir: Path, chat_template: str | None = None):
    """The model's tokenizer; ``chat_template`` (the template's text, common.model_source) replaces
    the one the model ships, as vLLM's ``--chat-template`` does."""
    if generic_fast_tokenizer(model_dir):  # the same tokenizer, without AutoTokenizer's imports
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def eos_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(eos)
            if eos is not None:
                break
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
