"""Landing a pulled chunk: the receiver reads the sender's blocks in place from the shared memory
region its transport mapped (the same-host backend), with no payload on the wire.

A pulled chunk's header is checked before anything is read (an authenticated header still may not
make this side read outside that region); its checksum is checked once the blocks are written,
since the bytes are only read then. A checksum that fails has written into its own request's
blocks only, and fails that request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kv_transfer.block_copy import BlockCopyPlan, copy_blocks, plan_block_copy
from kv_transfer.protocol import ChunkHeader, payload_matches
from kv_transfer.receiving.cache import ReceivingCache
from kv_transfer.receiving.checks import ChunkChecks
from kv_transfer.receiving.completion import Completion
from kv_transfer.receiving.transfer import ChunkKey, IncomingTransfer


@dataclass(frozen=True, slots=True)
class PullPlan:
    """What the pulled layers of one transfer share, checked once: the header fields that decide the
    source blocks' shape and place, the sender's block ids, and their copy plan into the window."""

    checked: tuple[int, ...]
    src_block_ids: list[int]
    copy: BlockCopyPlan


class PullGroup(NamedTuple):
    """Consecutive layers of a pulled batch that lie back to back in the sender's region: one copy."""

    layers: list[ChunkHeader]
    keys: list[ChunkKey]
    source: torch.Tensor  # [layers, 2, blocks, block_size, heads, head_dim], in the sender's region
    plan: BlockCopyPlan


class PulledLanding:
    def __init__(self, cache: ReceivingCache, checks: ChunkChecks, completion: Completion) -> None:
        self.cache = cache
        self.checks = checks
        self.completion = completion

    def land(self, incoming: IncomingTransfer, header: ChunkHeader, regions: Mapping[int, torch.Tensor] | None) -> None:
        key = self.checks.check_chunk(incoming, header)
        heads = slice(header.dst_head_offset, header.dst_head_offset + header.num_heads)
        dst = self.cache.kv_caches[header.layer][:, :, :, heads]
        source, plan = self._source(incoming, header, regions)
        copy_blocks(dst, source, plan)
        if not self.intact(incoming, header, dst):
            self.checks.checksum_failed(incoming, header)
        self.completion.landed(incoming, [header], [key], header.nbytes, in_place=True)

    def plan_batch(
        self,
        incoming: IncomingTransfer,
        layers: list[ChunkHeader],
        regions: Mapping[int, torch.Tensor] | None,
        max_group_bytes: int,
    ) -> list[PullGroup]:
        """Several pulled layers, grouped: consecutive layers that sit back to back on both sides move
        in one copy per block run (a per-layer copy costs ~50 us of Python, as much as a 1k-token
        layer's bytes), at most ``max_group_bytes`` a group. Every group is checked before anything
        is written: a refused batch writes nothing. Needs the receiver's stacked layers."""
        keys = self.checks.check_batch(incoming, layers)
        first, layout = layers[0], self.cache.layout
        src_layer_bytes = (
            2 * first.src_num_blocks * layout.block_size * first.src_heads * layout.head_dim
        ) * self.cache.dtype.itemsize
        most = max(1, max_group_bytes // max(1, first.nbytes))  # layers per group
        groups: list[PullGroup] = []
        start = 0
        while start < len(layers):
            end = start + 1
            while (
                end < len(layers)
                and end - start < most
                and layers[end].layer == layers[end - 1].layer + 1
                and layers[end].src_region == layers[start].src_region
                and layers[end].src_offset == layers[end - 1].src_offset + src_layer_bytes
            ):
                end += 1
            source, plan = self._source(incoming, layers[start], regions, num_layers=end - start)
            groups.append(PullGroup(layers[start:end], keys[start:end], source, plan))
            start = end
        return groups

    def copy_group(self, incoming: IncomingTransfer, group: PullGroup) -> int:
        """Copy one group into the reserved blocks; the index of its first layer whose checksum
        fails (its length if none does). Recording what landed is the caller's."""
        assert self.cache.stacked is not None
        layers = group.layers
        heads = slice(layers[0].dst_head_offset, layers[0].dst_head_offset + layers[0].num_heads)
        dst = self.cache.stacked[layers[0].layer : layers[-1].layer + 1, :, :, :, heads]
        copy_blocks(dst, group.source, group.plan, dim=2)
        intact = (self.intact(incoming, header, dst[i]) for i, header in enumerate(layers))
        return next((i for i, ok in enumerate(intact) if not ok), len(layers))

    def intact(self, incoming: IncomingTransfer, header: ChunkHeader, dst: torch.Tensor) -> bool:
        """Whether a pulled layer, now in ``dst``, passes the check its header carries."""
        if header.checksum is None:
            return True
        scatter = incoming.windows[(header.block_offset, header.num_blocks)].scatter  # checked with its key
        return payload_matches(header.checksum, incoming.ticket.secret, _payload_bytes(dst, scatter))

    def _source(
        self,
        incoming: IncomingTransfer,
        header: ChunkHeader,
        regions: Mapping[int, torch.Tensor] | None,
        num_layers: int | None = None,
    ) -> tuple[torch.Tensor, BlockCopyPlan]:
        """The sender's blocks of this chunk, viewed in place in its shared region (checked first:
        an authenticated header still may not make this side read outside that region). With
        ``num_layers``, that many layers lying back to back from ``src_offset``, stacked."""
        layout = self.cache.layout
        region = None if regions is None else regions.get(header.src_region)
        if region is None:
            self.checks.refuse(
                "shape", f"layer {header.layer}: the sender's memory region {header.src_region} is unknown"
            )
        itemsize = self.cache.dtype.itemsize
        src_ids = header.src_block_ids or []
        shape = (2, header.src_num_blocks, layout.block_size, header.src_heads, layout.head_dim)
        layer_bytes = torch.Size(shape).numel() * itemsize
        # Every layer of a transfer names the same blocks and heads: check those once per request.
        checked = (
            header.src_num_blocks,
            header.src_heads,
            header.src_head_offset,
            header.num_heads,
            header.nbytes,
            header.block_offset,
            header.num_blocks,
        )
        cached = incoming.pull_plan
        if cached is None or cached.checked != checked or cached.src_block_ids != src_ids:
            reserved = self.checks.window(incoming, header).block_ids
            expected_bytes = 2 * len(reserved) * layout.block_size * header.num_heads * layout.head_dim
            problems = [
                len(src_ids) != len(reserved) and f"{len(src_ids)} source blocks for {len(reserved)} reserved",
                header.nbytes != expected_bytes * itemsize
                and f"{header.nbytes} bytes, expected {expected_bytes * itemsize}",
                header.dst_head_offset + header.num_heads > layout.num_kv_heads
                and f"heads [{header.dst_head_offset}, +{header.num_heads}) exceed this shard",
                (header.src_head_offset < 0 or header.src_head_offset + header.num_heads > header.src_heads)
                and "source heads out of range",
                bool(src_ids)
                and (min(src_ids) < 0 or max(src_ids) >= header.src_num_blocks)
                and "source block ids out of range",
            ]
            problem = next((p for p in problems if p), None)
            if problem:
                self.checks.refuse("shape", f"layer {header.layer}: {problem}")
            cached = incoming.pull_plan = PullPlan(checked, src_ids, plan_block_copy(src_ids, reserved))
        span = layer_bytes * (num_layers or 1)
        if header.src_offset < 0 or header.src_offset % itemsize or header.src_offset + span > len(region):
            self.checks.refuse("shape", f"layer {header.layer}: source tensor outside the shared region")
        source = region[header.src_offset : header.src_offset + span].view(self.cache.dtype)
        source = source.view(shape if num_layers is None else (num_layers, *shape))
        return source.narrow(-2, header.src_head_offset, header.num_heads), cached.copy


def _payload_bytes(dst: torch.Tensor, scatter: BlockCopyPlan) -> memoryview:
    """The bytes a payload of these blocks would have carried (to checksum a pulled chunk)."""
    blocks = dst.index_select(1, scatter.dst_index.to(dst.device)).contiguous().cpu()
    return memoryview(blocks.view(torch.uint8).numpy()).cast("B")
