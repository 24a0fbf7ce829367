"""Where a shard's KV cache lives: private memory, or one shared region another process can map.

A shared cache lets a same-host transport (kv_transfer's shm backend) read a request's blocks in
place, so a prefill-to-decode hand-off copies each byte once instead of twice. Only CPU caches can
be shared this way; a CUDA cache is always allocated by torch.
"""

from __future__ import annotations

import mmap

import torch

from common.shared_memory import MAP_POPULATE, SharedRegion, close_shared_region, create_shared_region

_PRIVATE_POPULATED = mmap.MAP_PRIVATE | MAP_POPULATE


def allocate_kv_caches(
    layer_shape: tuple[int, ...], num_layers: int, dtype: torch.dtype, device: torch.device, *, shared: bool = False
) -> tuple[list[torch.Tensor], SharedRegion | None]:
    """One zeroed tensor per layer, all views of one allocation, layer after layer (a transfer can
    then move a block range of many layers in one copy); with ``shared`` (CPU only), that
    allocation is a shared region.

    On CPU the allocation is a fresh mapping whose pages the kernel hands out zeroed, all at once
    (populated): a step never stops on a page fault to touch a block for the first time, which
    a cache of gigabytes would otherwise do for every block of its first pass through the pool."""
    if device.type != "cpu":
        stacked = torch.zeros((num_layers, *layer_shape), dtype=dtype, device=device)
        return list(stacked.unbind(0)), None
    layer_bytes = torch.Size(layer_shape).numel() * torch.empty((), dtype=dtype).element_size()
    nbytes = max(1, layer_bytes * num_layers)
    region = create_shared_region(nbytes, populate=True) if shared else None
    buffer = region.buffer if region is not None else mmap.mmap(-1, nbytes, flags=_PRIVATE_POPULATED)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    layers = [flat[i * layer_bytes : (i + 1) * layer_bytes].view(dtype).view(layer_shape) for i in range(num_layers)]
    return layers, region


def release_kv_caches(region: SharedRegion | None) -> None:
    if region is not None:
        close_shared_region(region)
