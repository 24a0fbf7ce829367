"""The tokenizer the engine and the router load: the generic fast class where the files describe
the whole tokenizer (no AutoTokenizer imports at start), the same tokens, text and chat template."""

from __future__ import annotations

import json
import shutil

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from common.tokenizer_files import generic_fast_tokenizer
from engine.tokenizer import load_tokenizer

TEXTS = ["Hello there, world", "  leading spaces\tand tabs\n", "naïve café — 東京 🙂", "def f(x):\n    return x**2"]


def test_the_default_model_loads_the_same_tokenizer_without_auto_tokenizer(smol_dir):
    assert generic_fast_tokenizer(smol_dir)
    fast, auto = load_tokenizer(smol_dir), AutoTokenizer.from_pretrained(str(smol_dir))
    assert isinstance(fast, PreTrainedTokenizerFast) and len(fast) == len(auto)
    for text in TEXTS:
        ids = auto.encode(text)
        assert fast.encode(text) == ids and fast.decode(ids) == auto.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) == list(
        auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    assert (fast.eos_token_id, fast.bos_token_id, fast.all_special_ids) == (
        auto.eos_token_id,
        auto.bos_token_id,
        auto.all_special_ids,
    )


def test_a_tokenizer_class_with_behaviour_of_its_own_goes_through_auto_tokenizer(tmp_path, smol_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert not generic_fast_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert not generic_fast_tokenizer(tmp_path)  # no tokenizer.json: nothing describes it whole
