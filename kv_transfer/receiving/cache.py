"""This shard's KV cache as the landings write into it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kv_layout import KVCacheLayout
from kv_transfer.block_copy import stacked_layers

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ReceivingCache:
    kv_caches: list[torch.Tensor]  # one [2, blocks, block_size, heads, head_dim] tensor per layer
    layout: KVCacheLayout
    dtype: torch.dtype  # the layout's
    stacked: torch.Tensor | None  # [layers, ...] when they share one allocation

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> ReceivingCache:
        return cls(kv_caches, layout, _DTYPES[layout.dtype], stacked_layers(kv_caches))
