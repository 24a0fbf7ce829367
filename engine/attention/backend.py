"""The attention-backend interface and its lazy registry.

A backend turns one step's flattened batch into metadata once (``build_metadata``), then, per
layer, writes the step's new keys/values into the paged cache and attends over it (``forward``).
Models never see block tables: a CUDA backend plugs in here without touching them.

The step's tokens are ordered decodes first (one token each), then prefill chunks::

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
              decodes    prefill 0     prefill 1 (a later chunk: attends to earlier KV too)
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepTensors:
    """What every shard builds from the driver's step message; lists are per sequence."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens]
    num_decodes: int  # the first num_decodes sequences have one token each
    query_lens: list[int]
    seq_lens: list[int]  # context length after this step (start position + query length)
    block_tables: list[list[int]]
    logits_indices: torch.Tensor  # token index whose hidden state is sampled, per sampling sequence


class AttentionMetadata:
    """Backend-specific; built once per step and shared by every layer."""


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def build_metadata(self, step: StepTensors, block_size: int) -> AttentionMetadata:
        """Called once per step on every shard before the forward pass; may allocate, never blocks."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (rotary applied); kv_cache is one layer's tensor (see
        common.kv_layout). Writes k/v into their slots, returns attention output [T, Hq, D]."""


_BACKENDS = {
    "torch": "engine.attention.torch_paged:TorchPagedAttention",
    "triton": "engine.attention.triton_paged:TritonPagedAttention",  # imports Triton: CUDA, or its interpreter
}


def get_backend(name: str = "torch", **options: Any) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(**options)
