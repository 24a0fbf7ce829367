"""The tensor-parallel group one model instance runs on, and its collectives.

Two process groups over the same ranks: ``group`` carries activations (NCCL on CUDA, gloo on
CPU), ``cpu_group`` (always gloo) carries the driver's step messages, so control never needs a
device tensor. With one shard there are no groups and every collective is the identity.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common.nccl_env import group_construction


@contextlib.contextmanager
def gloo_on_loopback() -> Iterator[None]:
    """Gloo groups made inside bind the loopback interface: a replica's shards always share a host
    (one STRICT_PACK placement group, or the offline engine's own processes), and gloo otherwise
    binds the address the host name resolves to, a listener reachable from the network. An
    operator's own GLOO_SOCKET_IFNAME is kept."""
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is None or "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = loopback
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def shard_device(device: torch.device, rank: int) -> torch.device:
    """Shard ``rank``'s device. On CUDA, the ``rank``-th GPU from the requested one among those this
    process sees: offline, ``cuda:N`` puts shard r on GPU N + r; under Ray each shard's process sees
    only the GPU Ray gave it (CUDA_VISIBLE_DEVICES), so every shard is on its own GPU as cuda:0."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", ((device.index or 0) + rank) % max(1, torch.cuda.device_count()))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls, device: torch.device) -> TensorParallel:
        return cls(device=device)

    @classmethod
    def init(cls, rank: int, size: int, store: dist.Store, device: torch.device, timeout_s: float) -> TensorParallel:
        """Join the group (every rank calls this) through ``store``, which rank 0 serves."""
        if size == 1:
            return cls.single(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        # NCCL reads its error handling from the environment as the group is made: made under the
        # lock the KV transport changes it under, so this group keeps torch's default.
        with group_construction() if device.type == "cuda" else gloo_on_loopback():
            dist.init_process_group(
                backend=backend_for(device), store=store, rank=rank, world_size=size, timeout=timeout
            )
        group = dist.group.WORLD
        if device.type == "cpu":
            cpu_group = group
        else:
            with gloo_on_loopback():
                cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        return cls(rank=rank, size=size, device=device, group=group, cpu_group=cpu_group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every shard's ``x`` along the last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def all_reduce_min_cpu(self, value: int) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0 sends ``payload`` to every shard over the CPU group; others pass None and receive it."""
        if self.size == 1:
            assert payload is not None
            return payload
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.cpu_group)
        if self.is_driver:
            assert payload is not None
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self.cpu_group)
        return payload if self.is_driver and payload is not None else buffer.numpy().tobytes()

    def gather_bytes_to_driver(self, payload: bytes) -> list[bytes] | None:
        """Every shard's ``payload`` on rank 0 (rank order), over the CPU group; None elsewhere."""
        if self.size == 1:
            return [payload]
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=self.cpu_group)
        longest = max(int(t.item()) for t in sizes)
        buffer = torch.zeros(longest, dtype=torch.uint8)
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else buffer[:0]
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)] if self.is_driver else None
        dist.gather(buffer, parts, dst=0, group=self.cpu_group)
        if parts is None:
            return None
        return [part[: int(size.item())].numpy().tobytes() for part, size in zip(parts, sizes, strict=True)]

    def destroy(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
