"""The KV-cache layout contract (torch-free). engine allocates it, kv_transfer reads and writes exactly
this; change it only here.

One tensor per layer, preallocated at start::

    kv[layer] : [2, num_blocks, block_size, num_kv_heads, head_dim]      (dtype of the model)
                 │       │          │            │           └ contiguous head vector
                 │       │          │            └ this shard's KV heads, global ids
                 │       │          │              kv_head_start .. kv_head_start + num_kv_heads - 1
                 │       │          └ offset of the token inside its block
                 │       └ block id (what block tables and tickets name)
                 └ 0 = key (after rotary embedding), 1 = value

A token at position p of a request whose block table is ``blocks`` lives in slot
``blocks[p // block_size] * block_size + p % block_size``; ``kv[layer][i].view(-1, H, D)[slot]``
is its key (i = 0) or value (i = 1). One block of one layer is ``kv[layer][:, block_id]``:
``2 * block_size * num_kv_heads * head_dim`` elements, keys then values, each contiguous.

With tensor parallelism each shard holds its own tensors for its KV heads; when TP exceeds the
model's KV heads, heads are replicated (shard r holds head ``r * total_kv_heads // tp_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    num_kv_heads: int  # held by this shard
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    total_kv_heads: int  # in the model
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def kv_head_start(self) -> int:
        return self.tp_rank * self.total_kv_heads // self.tp_size

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block_per_layer(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * _ITEMSIZE[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.bytes_per_block_per_layer

    @property
    def bytes_total(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict) -> KVCacheLayout:
        return cls(**data)


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: str) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * _ITEMSIZE[dtype]
