"""This shard's KV cache as the landings write into it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.kv_layout import KVCacheLayout
from kv_transfer.block_copy import stacked_layers
from kv_transfer.device_streams import HostStaging

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ReceivingCache:
    kv_caches: list[torch.Tensor]  # one [2, blocks, block_size, heads, head_dim] tensor per layer
    layout: KVCacheLayout
    dtype: torch.dtype  # the layout's
    stacked: torch.Tensor | None  # [layers, ...] when they share one allocation
    # A GPU cache's payloads land through pinned host memory (used under the receiver's lock).
    staging: HostStaging = field(default_factory=HostStaging)

    @property
    def device(self) -> torch.device:
        return self.kv_caches[0].device

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> ReceivingCache:
        return cls(kv_caches, layout, _DTYPES[layout.dtype], stacked_layers(kv_caches))
