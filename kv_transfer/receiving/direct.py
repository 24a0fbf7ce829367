"""Landing a chunk received in place: the transport receives its payload straight into the reserved
blocks (outside the receiver's lock, no copy); the receiver's release() waits for such a write to end.

    begin   the header checked and the targets reserved (lock held)   ─▶ DirectWrite
    verify  the payload's checksums, once every byte is in (no lock: a chunk may be hundreds of MB)
    end     recorded by the receiver (lock held), or the transfer failed if the payload fell short

Only a chunk carrying every head of this shard, for blocks whose runs are few, qualifies; anything
else is refused (the sender then sends the payload to be copied).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kv_transfer.errors import NotInPlace
from kv_transfer.protocol import MAX_DIRECT_RUNS, ChunkHeader, payload_matches
from kv_transfer.receiving.cache import ReceivingCache
from kv_transfer.receiving.checks import ChunkChecks
from kv_transfer.receiving.transfer import ChunkKey, IncomingTransfer

# (layer, byte offset, length) of a target in its layer's bytes. A plain tuple, not a NamedTuple:
# a chunk has up to MAX_DIRECT_PIECES of them, and a NamedTuple costs ~0.2 us more each to make.
TargetSpan = tuple[int, int, int]


@dataclass(frozen=True, slots=True, eq=False)
class DirectWrite:
    """A chunk the transport receives straight into reserved blocks: ``targets`` (or ``views()``)
    are contiguous byte views of those blocks, in payload order (layer by layer; in each, K then V,
    each by run of consecutive blocks)."""

    request_id: str
    layers: list[ChunkHeader]  # one header per layer the chunk carries
    keys: list[ChunkKey]
    spans: list[TargetSpan]
    layer_bytes: list[torch.Tensor | None] = field(repr=False)  # the receiver's layers as flat bytes
    layer_views: list[memoryview | None] = field(repr=False)  # the same, as memoryviews (a CPU cache)
    lease_left_s: float  # the transport must end the write by then (the sender's clock is not ours)
    incoming: IncomingTransfer = field(repr=False)
    # The transport's way to cut the payload short (a gRPC call's cancel); release() calls it
    # rather than wait for a stalled sender. Without one, the transport bounds the wait itself.
    abort: list[Callable[[], object]] = field(default_factory=list, repr=False)

    @property
    def targets(self) -> list[torch.Tensor]:
        """The targets as uint8 tensors (on the cache's device)."""
        flat = self.layer_bytes
        return [flat[layer].narrow(0, offset, length) for layer, offset, length in self.spans]  # type: ignore[union-attr]

    def views(self) -> list[memoryview] | None:
        """The targets as writable memoryviews, sliced without a tensor op each; None for a GPU cache."""
        views = self.layer_views
        if any(views[layer] is None for layer, _, _ in self.spans):
            return None
        return [views[layer][offset : offset + length] for layer, offset, length in self.spans]  # type: ignore[index]


class BlockRun(NamedTuple):
    """Consecutive reserved blocks a payload received in place comes in one piece for (K, then V)."""

    first_block: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class DirectPlan:
    """The runs of one window cut where the sender said, checked once per transfer."""

    block_offset: int
    num_blocks: int
    run_lengths: list[int]
    runs: list[BlockRun]


class DirectLanding:
    def __init__(self, cache: ReceivingCache, checks: ChunkChecks) -> None:
        self.layout = cache.layout
        self.checks = checks
        # Each contiguous layer as flat bytes: a payload received in place lands in slices of these.
        self.layer_bytes = [kv.view(-1).view(torch.uint8) if kv.is_contiguous() else None for kv in cache.kv_caches]
        self.layer_views = [
            memoryview(flat.numpy()) if flat is not None and flat.device.type == "cpu" else None
            for flat in self.layer_bytes
        ]

    def begin(
        self,
        incoming: IncomingTransfer,
        header: ChunkHeader,
        nbytes: int,
        num_pieces: int | None,
        abort: Callable[[], object] | None,
    ) -> DirectWrite:
        """Check a chunk of ``nbytes`` to be received in place (``header.batch``: several layers) in
        ``num_pieces`` messages (None: streamed bytes), and reserve its targets in ``incoming``."""
        checks = self.checks
        layers = checks.layers_of(header, payload_batch=True)
        keys = checks.check_batch(incoming, layers)
        layer_bytes = checks.layer_bytes_of(header.num_blocks)  # the window's (checked with the keys)
        if header.num_heads != self.layout.num_kv_heads or header.dst_head_offset != 0:
            checks.refuse("shape", f"layer {header.layer}: a chunk received in place carries every head")
        if layer_bytes != header.nbytes or nbytes != layer_bytes * len(layers):
            checks.refuse("shape", f"layer {header.layer}: {nbytes} bytes, expected {layer_bytes * len(layers)}")
        runs = self._runs(incoming, header)
        if num_pieces is not None and len(layers) * 2 * len(runs) != num_pieces:
            checks.refuse("shape", f"{num_pieces} pieces, expected {len(layers) * 2 * len(runs)}")
        block_bytes = layer_bytes // (2 * header.num_blocks)
        flats = [self.layer_bytes[layer.layer] for layer in layers]  # each [K blocks | V blocks]
        for layer, flat in zip(layers, flats, strict=True):
            if flat is None:
                checks.refusals["not_in_place"] += 1
                raise NotInPlace(f"layer {layer.layer} of this cache is not contiguous")
        half = flats[0].numel() // 2  # type: ignore[union-attr]  # every layer has one shape
        spans_of_layer = [(part * half + dst * block_bytes, n * block_bytes) for part in (0, 1) for dst, n in runs]
        spans = [(layer.layer, offset, length) for layer in layers for offset, length in spans_of_layer]
        incoming.writing.update(keys)
        write = DirectWrite(
            incoming.ticket.request_id,
            layers,
            keys,
            spans,
            self.layer_bytes,
            self.layer_views,
            incoming.ticket.lease_deadline - time.monotonic(),
            incoming,
            [abort] if abort is not None else [],
        )
        incoming.in_flight.append(write)
        return write

    @staticmethod
    def verify(write: DirectWrite, received: bool) -> list[bool]:
        """Whether each layer of a payload received whole passes its check ([] if not received).
        Needs no lock: the blocks stay reserved until the write ends, so nothing else touches them."""
        if not received:
            return []
        if all(header.checksum is None for header in write.layers):
            return [True] * len(write.layers)
        views = write.views()
        parts = views if views is not None else [memoryview(t.cpu().numpy()) for t in write.targets]
        per_layer = len(parts) // len(write.layers)
        secret = write.incoming.ticket.secret
        return [
            payload_matches(header.checksum, secret, *parts[i * per_layer : (i + 1) * per_layer])
            for i, header in enumerate(write.layers)
        ]

    def _runs(self, incoming: IncomingTransfer, header: ChunkHeader) -> list[BlockRun]:
        """The runs a payload received in place comes in: the window's reserved blocks in order, cut
        where the sender said, each run consecutive here too."""
        run_lengths = header.run_lengths
        cached = incoming.direct_plan
        if (
            cached is None
            or cached.block_offset != header.block_offset
            or cached.num_blocks != header.num_blocks
            or cached.run_lengths != run_lengths
        ):
            reserved = self.checks.window(incoming, header).block_ids
            if (
                not isinstance(run_lengths, list)
                or not 0 < len(run_lengths) <= MAX_DIRECT_RUNS
                or not all(isinstance(n, int) and n > 0 for n in run_lengths)
                or sum(run_lengths) != len(reserved)
            ):
                self.checks.refuse("shape", f"runs {run_lengths!r} do not cover the {len(reserved)} reserved blocks")
            runs, start = [], 0
            for n in run_lengths:
                first = reserved[start]
                if list(reserved[start : start + n]) != list(range(first, first + n)):
                    self.checks.refuse(
                        "shape", f"run of {n} blocks from reserved block {first} is not consecutive here"
                    )
                runs.append(BlockRun(first, n))
                start += n
            cached = incoming.direct_plan = DirectPlan(header.block_offset, header.num_blocks, list(run_lengths), runs)
        return cached.runs
