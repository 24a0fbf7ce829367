"""Random-weight Llama-family checkpoints with SmolLM2's tokenizer, built from a fixed seed.

Tests use tiny ones (their TP degrees divide the heads); ``bench.cuda_check`` builds one of
SmolLM2-135M's shape where the real weights cannot travel. Weights are drawn with a std chosen so
greedy choices have clear margins (the checkpoints' own init gives near-ties), and biases, where the
architecture or ``config_overrides`` (``attention_bias``, ``mlp_bias``) has them, are random too
(transformers starts them at zero, which would hide a misplaced one)."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# SmolLM2-135M-Instruct's shape (its config.json), for a stand-in with random weights.
SMOL_SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_heads": 9,
    "num_kv_heads": 3,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
}


def build_tiny_llama(
    out_dir: Path,
    tokenizer_dir: Path,
    *,
    num_heads=4,
    num_kv_heads=2,
    seed=0,
    tie_word_embeddings=False,
    model_type="llama",
    rope_scaling=None,
    weight_std=0.2,
    **config_overrides,
) -> Path:
    """A random-weight model in ``out_dir`` (2 layers of width 64 unless overridden), with the
    tokenizer files found in ``tokenizer_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=49152,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        **({"rope_scaling": rope_scaling} if rope_scaling else {}),
        **{
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "max_position_embeddings": 2048,
            **config_overrides,
        },
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, weight_std)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(out_dir))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def build_smol_shaped(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """SmolLM2-135M's shape with random weights: its speed, not its words. A std of 1.6 over the
    square root of the width keeps each product's gain near the tiny models' (0.2 x sqrt(64))."""
    shape = dict(SMOL_SHAPE)
    return build_tiny_llama(
        out_dir,
        tokenizer_dir,
        num_heads=shape.pop("num_heads"),
        num_kv_heads=shape.pop("num_kv_heads"),
        tie_word_embeddings=shape.pop("tie_word_embeddings"),
        seed=seed,
        weight_std=1.6 / shape["hidden_size"] ** 0.5,
        **shape,
    )
