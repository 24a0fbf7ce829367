"""Where a shard's KV cache lives: private memory, or one shared region another process can map.

A shared cache lets a same-host transport (kv_transfer's shm backend) read a request's blocks in
place, so a prefill-to-decode hand-off copies each byte once instead of twice. Only CPU caches can
be shared this way; a CUDA cache is always allocated by torch.

How large it is: ``kv_cache_memory`` (a fraction of the memory free once the weights are loaded,
or bytes), or on CUDA vLLM's ``gpu_memory_utilization`` (a share of the device's total memory,
``gpu_kv_budget``).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from common.errors import ConfigError
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


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory as ``torch.cuda.mem_get_info`` reads it, once the weights are loaded."""

    total: int
    free: int

    @property
    def used(self) -> int:
        """Weights, the CUDA context, and whatever else holds the device (other processes too)."""
        return self.total - self.free


def gpu_kv_budget(utilization: float, memory: DeviceMemory, reserved: int) -> int:
    """The KV cache's bytes under vLLM's ``--gpu-memory-utilization``: the share of the device's
    total memory this shard may hold, less what already holds it (weights, context, other
    processes) and ``reserved`` for what the steps will take (activations at their peak, the
    decode graphs' pool):

        budget = utilization × total − (total − free) − reserved

    vLLM measures its peak with a profiling forward pass; ``reserved`` is an estimate of the same
    (``activation_reserve`` plus the graphs' reserve). ConfigError when nothing is left."""
    budget = int(utilization * memory.total) - memory.used - reserved
    if budget <= 0:
        gib = 2**30
        raise ConfigError(
            f"gpu_memory_utilization={utilization} leaves no KV cache: {utilization:g} × "
            f"{memory.total / gib:.1f} GiB total is {utilization * memory.total / gib:.2f} GiB, and "
            f"{memory.used / gib:.2f} GiB is in use (weights, CUDA context, other processes) with "
            f"{reserved / gib:.2f} GiB kept for activations; raise --gpu-memory-utilization or free the device"
        )
    return budget


def activation_reserve(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    hidden: int,
    q_width: int,
    kv_width: int,
    intermediate: int,
    vocab_size: int,
    itemsize: int,
) -> int:
    """The most a step's activations hold at once, estimated: a full token budget through one layer
    (residual, norms, q/k/v, the MLP's gate, up and product: earlier layers' are freed as the next
    one runs) twice over for the allocator's slack, and the float32 logits of every sequence's
    sampled row (plus a softmax's copy)."""
    per_token = (4 * hidden + q_width + 2 * kv_width + 3 * intermediate) * itemsize
    logits = 2 * max_num_seqs * vocab_size * 4
    return 2 * max_num_batched_tokens * per_token + logits
