"""Copying a request's blocks between KV tensors of layout [2, blocks, block_size, heads, head_dim].

Block ids that run consecutively on both sides (a fresh cache hands them out in order) coalesce
into slices: one ``copy_`` per run moves memory at memcpy speed, where an index gather or scatter
runs at roughly half of it here (measured: 1k-token SmolLM2 layer, 15 GB/s memcpy, index_copy_
8-15 GB/s, gather then scatter 5-9 GB/s). Fragmented ids fall back to the index kernels.

Copies run on torch's intra-op threads. Forcing one thread would avoid waking them for small
copies, but torch.set_num_threads also sets the count every torch thread created afterwards
starts with (checked: a thread started later reads 1), and numpy or memmove single-threaded
copies measured 30-60% slower than torch's here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MAX_RUN_SHARE = 8  # slices only while there are at most len(ids) / 8 runs (plus a few)


@dataclass(frozen=True, slots=True)
class BlockCopyPlan:
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]
    runs: list[tuple[int, int, int]] | None  # (src start, dst start, length), or None: use the indexes
    src_is_all: bool = False  # the source is exactly these blocks, in order (nothing to gather)
    dst_is_all: bool = False  # the destination is exactly these blocks, in order (nothing to scatter)

    @property
    def num_blocks(self) -> int:
        return len(self.src_ids)

    # Index tensors made on first use, by a copy that takes the index kernels: most plans are a few
    # runs, and two tensors cost ~10 us a plan (a receiver plans every request).
    _indexes: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def src_index(self) -> torch.Tensor:
        return self._index_tensors()[0]

    @property
    def dst_index(self) -> torch.Tensor:
        return self._index_tensors()[1]

    def _index_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        indexes = self._indexes
        if indexes is None:
            indexes = (torch.tensor(self.src_ids, dtype=torch.long), torch.tensor(self.dst_ids, dtype=torch.long))
            object.__setattr__(self, "_indexes", indexes)  # a cache, not state: frozen otherwise
        return indexes


def plan_block_copy(src_ids: list[int], dst_ids: list[int]) -> BlockCopyPlan:
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            start_s, start_d, length = runs[-1]
            runs[-1] = (start_s, start_d, length + 1)
        else:
            runs.append((s, d, 1))
    coalesced = runs if len(runs) <= 4 + len(src_ids) // _MAX_RUN_SHARE else None
    identity = list(range(len(src_ids)))
    return BlockCopyPlan(
        tuple(src_ids),
        tuple(dst_ids),
        coalesced,
        src_is_all=list(src_ids) == identity,
        dst_is_all=list(dst_ids) == identity,
    )


def gather_plan(src_ids: list[int]) -> BlockCopyPlan:
    """Gathering ``src_ids`` into a contiguous tensor of exactly those blocks, in order."""
    return plan_block_copy(src_ids, list(range(len(src_ids))))


def scatter_plan(dst_ids: list[int]) -> BlockCopyPlan:
    """Scattering a contiguous tensor of blocks into ``dst_ids``."""
    return plan_block_copy(list(range(len(dst_ids))), dst_ids)


def copy_blocks(dst: torch.Tensor, src: torch.Tensor, plan: BlockCopyPlan, dim: int = 1) -> None:
    """``dst[..., plan.dst_index, ...] = src[..., plan.src_index, ...]`` along the block dimension
    ``dim`` (1 for one layer, 2 for a stack of layers), bits exactly."""
    on_cpu = dst.device.type == src.device.type == "cpu"
    if plan.runs is not None and (on_cpu or len(plan.runs) <= 4):  # on a GPU each run is a kernel launch
        for s, d, length in plan.runs:
            dst.narrow(dim, d, length).copy_(src.narrow(dim, s, length))
        return
    if dst.element_size() == 2 and dst.shape[-1] % 2 == 0 and dst.stride(-1) == 1 and src.stride(-1) == 1:
        # Bits only move: as float32 pairs the index kernels run ~1.8x faster than on bf16/fp16.
        dst, src = dst.view(torch.float32), src.view(torch.float32)
    src_index = plan.src_index.to(src.device)
    dst_index = plan.dst_index.to(dst.device)
    if src.device != dst.device:  # e.g. a host cache read into a GPU one: gather on the host, ship once
        dst.index_copy_(dim, dst_index, src.index_select(dim, src_index).to(dst.device))
    elif plan.dst_is_all and dst.shape[dim] == plan.num_blocks and dst.is_contiguous():
        torch.index_select(src, dim, src_index, out=dst)
    elif plan.src_is_all and src.shape[dim] == plan.num_blocks:
        dst.index_copy_(dim, dst_index, src)
    else:
        dst.index_copy_(dim, dst_index, src.index_select(dim, src_index))


def stacked_layers(layers: list[torch.Tensor]) -> torch.Tensor | None:
    """The layers as one [layers, ...] view when they lie back to back in one allocation (as
    engine.kv_cache_memory allocates them), else None."""
    first = layers[0]
    step = first.numel()
    storage = first.untyped_storage().data_ptr()
    for i, layer in enumerate(layers):
        if (
            not layer.is_contiguous()
            or layer.shape != first.shape
            or layer.dtype != first.dtype
            or layer.untyped_storage().data_ptr() != storage
            or layer.storage_offset() != first.storage_offset() + i * step
        ):
            return None
    return torch.as_strided(first, (len(layers), *first.shape), (step, *first.stride()), first.storage_offset())
