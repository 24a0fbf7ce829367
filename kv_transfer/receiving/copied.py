"""Landing a copied chunk: its payload's bytes copied into the reserved blocks, under the receiver's
lock (once release() returns, no chunk of that request can still be writing into blocks the engine
is about to reuse). A chunk carries one layer, or a batch of layers one after another.
"""

from __future__ import annotations

import torch

from kv_transfer.block_copy import copy_blocks
from kv_transfer.protocol import ChunkHeader, payload_matches
from kv_transfer.receiving.cache import ReceivingCache
from kv_transfer.receiving.checks import ChunkChecks
from kv_transfer.receiving.completion import Completion
from kv_transfer.receiving.transfer import IncomingTransfer


class CopiedLanding:
    def __init__(self, cache: ReceivingCache, checks: ChunkChecks, completion: Completion) -> None:
        self.cache = cache
        self.checks = checks
        self.completion = completion

    def land(
        self,
        incoming: IncomingTransfer,
        header: ChunkHeader,
        payload: Payload,
        checked: bool = False,  # the payload already passed its check (a batch checked whole)
    ) -> None:
        key = self.checks.check_chunk(incoming, header)
        heads = slice(header.dst_head_offset, header.dst_head_offset + header.num_heads)
        dst = self.cache.kv_caches[header.layer][:, :, :, heads]
        target = self._target_view(header, payload)
        if not checked and not payload_matches(
            header.checksum, incoming.ticket.secret, *self._checked_bytes(header, payload)
        ):
            self.checks.checksum_failed(incoming, header)
        copy_blocks(dst, target, self.checks.window(incoming, header).scatter)
        self.completion.landed(incoming, [header], [key], _nbytes(payload), in_place=False)

    def land_batch(self, incoming: IncomingTransfer, layers: list[ChunkHeader], payload: Payload) -> None:
        """Several layers carried one after another in the payload (the sender bounds it to 16 MB,
        so it is copied under one hold of the lock). Checked whole, checksums included, before
        anything is written."""
        keys = self.checks.check_batch(incoming, layers)
        view = payload.view(-1) if isinstance(payload, torch.Tensor) else memoryview(payload).cast("B")
        total = _nbytes(view)
        per_layer = total // len(layers)
        if per_layer * len(layers) != total:
            self.checks.refuse("shape", f"a payload of {total} bytes for {len(layers)} layers")
        first = self._target_view(layers[0], view[:per_layer])  # every layer has its shape
        for i, header in enumerate(layers):
            part = view[i * per_layer : (i + 1) * per_layer]
            if not payload_matches(header.checksum, incoming.ticket.secret, *self._checked_bytes(header, part)):
                self.checks.checksum_failed(incoming, header)
        consecutive = all(header.layer == layers[0].layer + i for i, header in enumerate(layers))
        if self.cache.stacked is None or not consecutive:
            for i, header in enumerate(layers):
                self.land(incoming, header, view[i * per_layer : (i + 1) * per_layer], checked=True)
            return
        # One copy per block run for all the layers (a per-layer copy costs ~100 us of Python).
        heads = slice(layers[0].dst_head_offset, layers[0].dst_head_offset + layers[0].num_heads)
        dst = self.cache.stacked[layers[0].layer : layers[-1].layer + 1, :, :, :, heads]
        if isinstance(view, torch.Tensor):  # already on the cache's device (an NCCL receive)
            source = view.view(first.dtype).view(len(layers), *first.shape)
        else:
            host = torch.frombuffer(view, dtype=torch.uint8).view(first.dtype).view(len(layers), *first.shape)
            source = self.cache.staging.to_device(host, dst.device)
        copy_blocks(dst, source, self.checks.window(incoming, layers[0]).scatter, dim=2)
        self.completion.landed(incoming, layers, keys, per_layer * len(layers), in_place=False)

    def _checked_bytes(self, header: ChunkHeader, payload: Payload) -> tuple[memoryview | bytes, ...]:
        """What the header's check runs over: the payload's bytes, brought to the host only when
        the header carries a check at all."""
        if not isinstance(payload, torch.Tensor):
            return (payload,)
        if header.checksum is None:
            return ()
        return (memoryview(self.cache.staging.to_host(payload, "check").numpy()),)

    def _target_view(self, header: ChunkHeader, payload: Payload) -> torch.Tensor:
        """The payload as the window's blocks of one layer, [2, blocks, block_size, heads, head_dim],
        on the cache's device (a payload received there already is viewed, not copied)."""
        layout = self.cache.layout
        shape = (2, header.num_blocks, layout.block_size, header.num_heads, layout.head_dim)  # the window's
        expected_bytes = torch.Size(shape).numel() * self.cache.dtype.itemsize
        if _nbytes(payload) != expected_bytes:
            self.checks.refuse("shape", f"layer {header.layer}: {_nbytes(payload)} bytes, expected {expected_bytes}")
        if header.dst_head_offset + header.num_heads > layout.num_kv_heads:
            self.checks.refuse("shape", f"heads [{header.dst_head_offset}, +{header.num_heads}) exceed this shard")
        if isinstance(payload, torch.Tensor):
            if payload.device != self.cache.device:
                self.checks.refuse("shape", f"a payload on {payload.device} for a cache on {self.cache.device}")
            return payload.view(self.cache.dtype).view(shape)
        raw = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        return self.cache.staging.to_device(raw.view(self.cache.dtype).view(shape), self.cache.device)


# Host bytes, or (a transport that received the payload on the cache's GPU: NCCL) a flat uint8 tensor there.
Payload = memoryview | bytes | torch.Tensor


def _nbytes(payload: Payload) -> int:
    return payload.numel() if isinstance(payload, torch.Tensor) else len(payload)
