"""Rotary position embeddings (Hugging Face's non-interleaved "rotate half" form) and the rope
scaling variants Llama-family configs use: default, linear, llama3, dynamic is refused.

cos/sin are computed once for every position in float32, exactly as transformers computes them,
then cast to the model dtype; a step gathers rows by position (the CPU layer loop,
``engine.models.llama_cpu``, has its kernel read them in place instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from common.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: dict) -> dict:
    """One dict from either transformers 5's ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or {})
    params.update(config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inv_frequencies(params: dict, rotary_dim: int) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise UnsupportedModelError(
        f"rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


@dataclass
class RotaryInputs:
    """One step's positions and the embedding's tables, shared by every layer: cos/sin rows are
    gathered once per step."""

    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    _gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, 1, head_dim] each."""
        if self._gathered is None:
            self._gathered = (self.cos_table[self.positions].unsqueeze(1), self.sin_table[self.positions].unsqueeze(1))
        return self._gathered


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = inv_frequencies(params, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def for_positions(self, positions: torch.Tensor) -> RotaryInputs:
        return RotaryInputs(positions, self.cos, self.sin)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: RotaryInputs):
    """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
    cos, sin = rope.cos_sin()
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
