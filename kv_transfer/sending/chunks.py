"""What every send path shares to write a chunk: its header, its payload's check, the time left
for it, and the scratch memory a payload is gathered in. Used by the sending thread only.
"""

from __future__ import annotations

import time

import torch

from common.kv_layout import KVCacheLayout
from kv_transfer.block_copy import BlockCopyPlan, copy_blocks
from kv_transfer.device_streams import HostStaging
from kv_transfer.protocol import ChunkHeader, payload_check
from kv_transfer.resharding import HeadSegment
from kv_transfer.sending.push import Push
from kv_transfer.ticket import KVTicket


def payload_view(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes without a copy (bf16 has no numpy dtype: view as bytes)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def block_bytes(layout: KVCacheLayout) -> int:
    """One block of one of K or V in a shard of this layout."""
    return layout.block_size * layout.num_kv_heads * layout.head_dim * getattr(torch, layout.dtype).itemsize


def segment_layer_bytes(push: Push, kv_layer: torch.Tensor, num_heads: int) -> int:
    """A layer's bytes of the window's blocks for ``num_heads`` heads."""
    num_blocks = len(push.window.src_block_ids)
    return 2 * num_blocks * kv_layer.shape[2] * num_heads * kv_layer.shape[4] * kv_layer.element_size()


def time_left(ticket: KVTicket) -> float:
    left = ticket.lease_deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("lease expired")
    return left


class ChunkWriter:
    def __init__(self, layout: KVCacheLayout, integrity: str) -> None:
        self.layout = layout
        self.integrity = integrity  # what each chunk's header carries to check its payload (protocol)
        self._scratch: dict[str, torch.Tensor] = {}
        # GPU layers come to the host through pinned memory, reused (the sending thread's only).
        self.host = HostStaging()

    def layer_header(
        self, push: Push, layer: int, seg: HeadSegment, nbytes: int, payload: memoryview | None
    ) -> ChunkHeader:
        ticket = push.ticket
        return ChunkHeader(
            kind="layer",
            request_id=ticket.request_id,
            sender_rank=self.layout.tp_rank,
            sender_tp=self.layout.tp_size,
            receiver_rank=seg.receiver_rank,
            layer=layer,
            dst_head_offset=seg.dst_head_offset,
            num_heads=seg.num_heads,
            block_offset=push.window.block_offset,
            num_blocks=len(push.window.src_block_ids),
            nbytes=nbytes,
            checksum=self.check(ticket, payload) if payload is not None else None,
        )

    def check(self, ticket: KVTicket, *parts: memoryview) -> int | bytes | None:
        return payload_check(self.integrity, ticket.secret, *parts)

    def spans_check(self, ticket: KVTicket, kv: torch.Tensor, spans: list[tuple[int, int]]) -> int | bytes | None:
        if kv.device.type == "cpu":
            flat = payload_view(kv)
            return self.check(ticket, *(flat[offset : offset + length] for offset, length in spans))
        flat_gpu = kv.view(-1).view(torch.uint8)  # only the pieces come to the host, not the whole layer
        host = self.host
        return self.check(
            ticket,
            *(
                payload_view(host.to_host(flat_gpu.narrow(0, offset, length), f"span{i}"))
                for i, (offset, length) in enumerate(spans)
            ),
        )

    def gather_blocks(self, kv_layer: torch.Tensor, plan: BlockCopyPlan) -> torch.Tensor:
        """The window's source blocks of one layer, contiguous, in reused scratch memory.

        Reuse matters: a fresh multi-MB tensor per layer costs page faults that run at ~1.5 GB/s
        here, while a gather into memory already touched runs at ~10 GB/s. The scratch is safe to
        reuse because a chunk's send returns only once its memory may be reused (the receiver
        consumed it, or, for a pipelined chunk, the kernel holds a copy).
        """
        full = self.scratch_tensor("blocks", (2, plan.num_blocks, *kv_layer.shape[2:]), kv_layer.dtype, kv_layer.device)
        copy_blocks(full, kv_layer, plan)
        return full

    def select_heads(self, blocks: torch.Tensor, head_offset: int, num_heads: int) -> torch.Tensor:
        if num_heads != blocks.shape[3]:
            part = self.scratch_tensor(
                "heads", (*blocks.shape[:3], num_heads, blocks.shape[4]), blocks.dtype, blocks.device
            )
            part.copy_(blocks[:, :, :, head_offset : head_offset + num_heads])
            blocks = part
        return self.host.to_host(blocks)

    def scratch_tensor(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * dtype.itemsize
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._scratch[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype).view(shape)
