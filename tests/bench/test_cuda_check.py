"""bench.cuda_check runs on CPU too: its checks must be able to fail there before a GPU runs them."""

from __future__ import annotations

import json

import torch

from bench import cuda_check
from bench.random_model import SMOL_SHAPE, build_smol_shaped


def test_the_smol_shaped_stand_in_has_smollm2_s_shape(tmp_path, smol_dir):
    built = json.loads((build_smol_shaped(tmp_path / "m", smol_dir) / "config.json").read_text())
    real = json.loads((smol_dir / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert built[key] == real[key], key
    assert built["tie_word_embeddings"] is SMOL_SHAPE["tie_word_embeddings"] is real["tie_word_embeddings"]
    assert (tmp_path / "m" / "tokenizer.json").exists()


def test_the_oracle_check_passes_on_cpu_and_catches_a_wrong_model(tmp_path, smol_dir, tiny_dir, monkeypatch):
    rows = cuda_check.check_oracle("tiny", tiny_dir, torch.device("cpu"), long_tokens=80, new_tokens=6)
    assert len(rows) == 10 and all(r["equal"] for r in rows)
    # Another seed's weights under the same name: transformers' tokens come from the first model.
    other = cuda_check.build_tiny_llama(tmp_path / "other", smol_dir, seed=1)
    real_hf = cuda_check.load_hf
    monkeypatch.setattr(cuda_check, "load_hf", lambda _dir, dtype, device: real_hf(tiny_dir, dtype, device))
    rows = cuda_check.check_oracle("other", other, torch.device("cpu"), long_tokens=80, new_tokens=6)
    assert not any(r["equal"] for r in rows)


def test_a_disaggregated_pair_decodes_what_transformers_does_and_frees_its_blocks(tiny_dir):
    rows = cuda_check.check_disagg(tiny_dir, torch.device("cpu"), ["inproc", "tcp"], long_tokens=80, new_tokens=6)
    assert [r["backend"] for r in rows] == ["inproc", "tcp"]
    assert all(r["equal"] and r["blocks left"] == 0 and r["errors"] == "" for r in rows), rows
