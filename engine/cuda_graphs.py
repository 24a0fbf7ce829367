"""Decode steps replayed as CUDA graphs: one graph per batch-size bucket, captured at start-up.

An eager decode step of a small model is bound by kernel launches, not by the GPU (~1.5k launches
a step for SmolLM2 eagerly). A graph replays the whole forward pass in one launch. Graphs need
fixed addresses, so a step's inputs go into static buffers that every graph reads::

    step of n decodes ──► bucket b = the smallest captured size >= n
      input_ids[:b]   ids, then 0            positions[:b]  positions, then 0
      slot_mapping[:b] slots, then -1 (stored nowhere)
      block_tables[:b] tables (padded with block 0), then rows of 0
      seq_lens[:b]    context lengths, then 0 (attends to nothing)
    replay graph b ──► hidden[:n]

The attention metadata of bucket b (``engine.attention.triton_paged``) is built once over views of
these buffers, so graphs survive any change of the KV cache's contents and of the scheduler's
batches. Padding rows compute garbage-free zeros and are cut off before sampling.

Off CUDA (the CPU tests) ``capture`` runs nothing ahead and ``run`` replays the same buffer
protocol eagerly: padded and unpadded batches must give the same tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.triton_paged import TritonAttentionMetadata, decode_splits, padded_tables
from engine.pinned_upload import PinnedUpload

logger = logging.getLogger(__name__)

# forward(input_ids, positions, metadata) -> hidden states [tokens, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, TritonAttentionMetadata], torch.Tensor]


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to the first size that holds ``max_batch``."""
    sizes: list[int] = []
    for size in [1, 2, 4, 8, *range(16, max(16, max_batch) + 16, 16)]:
        sizes.append(size)
        if size >= max_batch:
            break
    return sizes


def bucket_for(sizes: list[int], batch: int) -> int | None:
    """The smallest captured size that holds ``batch`` decodes (None: run eagerly)."""
    return next((size for size in sizes if size >= batch), None)


def memory_reserve(
    max_batch: int, hidden: int, q_width: int, kv_width: int, intermediate: int, itemsize: int, splits: int
) -> int:
    """Device memory to leave the graphs' pool when the KV cache takes a fraction of what is free:
    twice the largest bucket's activations of a layer (the pool holds one graph's peak; the others
    reuse it) and the split decode's float32 scratch, plus 64 MiB for the libraries' workspaces."""
    bucket = capture_sizes(max_batch)[-1]
    activations = bucket * (4 * hidden + q_width + 2 * kv_width + 3 * intermediate) * itemsize
    scratch = bucket * q_width * splits * 4 + bucket * (q_width // 8 + 1) * splits * 4
    return 2 * (activations + scratch) + 64 * 2**20


@dataclass
class DecodeBatch:
    """One step's decodes as the host knows them (every sequence one new token)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]


@dataclass
class CaptureReport:
    sizes: list[int]
    seconds: float
    memory_bytes: int  # device memory the graphs' pool took (0 off CUDA)


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        num_kv_heads: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.sizes = capture_sizes(max_batch)
        self.device = device
        self.max_blocks = -(-max_model_len // block_size)
        largest = self.sizes[-1]
        with torch.device(device):
            # One int64 buffer for the per-token inputs (ids, positions, slots): one copy a step.
            self.token_inputs = torch.zeros(3, largest, dtype=torch.long)
            self.token_inputs[2].fill_(-1)
            # Tables then lengths in one int32 buffer, for the same reason; each part contiguous
            # (the kernels read a length at seq_lens + row).
            self.seq_inputs = torch.zeros(largest * (self.max_blocks + 1), dtype=torch.int32)
        self.block_tables = self.seq_inputs[: largest * self.max_blocks].view(largest, self.max_blocks)
        self.seq_lens = self.seq_inputs[largest * self.max_blocks :]
        self.metadata = {
            size: TritonAttentionMetadata(
                slot_mapping=self.token_inputs[2, :size],
                num_decodes=size,
                decode_block_tables=self.block_tables[:size],
                decode_seq_lens=self.seq_lens[:size],
                num_splits=decode_splits(size, num_kv_heads, max_model_len, device),
            )
            for size in self.sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._upload_tokens = PinnedUpload(device, torch.long)
        self._upload_seqs = PinnedUpload(device, torch.int32)

    def fits(self, batch: DecodeBatch) -> bool:
        n = len(batch.input_ids)
        return 0 < n <= self.sizes[-1] and all(len(t) <= self.max_blocks for t in batch.block_tables)

    def capture(self) -> CaptureReport:
        """Capture every bucket's graph, largest first (the smaller ones reuse its memory pool).
        The buffers hold padding only while capturing: nothing is stored in the KV cache."""
        started = time.monotonic()
        if self.device.type != "cuda":
            return CaptureReport(self.sizes, 0.0, 0)
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # compiles the kernels for this shape outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        report = CaptureReport(self.sizes, time.monotonic() - started, max(0, free_before - free_after))
        logger.info(
            "CUDA graphs: %d decode buckets (1..%d) captured in %.1f s, %.1f MiB of device memory",
            len(self.sizes),
            self.sizes[-1],
            report.seconds,
            report.memory_bytes / 2**20,
        )
        return report

    def run(self, batch: DecodeBatch, carried: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """hidden states [n, hidden] of the batch's n decodes, through its bucket's graph; valid
        until the next ``run``. ``carried``: (rows, ids) on the device, written over the input
        ids the host did not know (async scheduling)."""
        n = len(batch.input_ids)
        size = bucket_for(self.sizes, n)
        assert size is not None and self.fits(batch), f"a batch of {n} has no graph"
        pad = size - n
        tokens = torch.tensor(
            [
                batch.input_ids + [0] * pad,
                batch.positions + [0] * pad,
                batch.slot_mapping + [-1] * pad,
            ],
            dtype=torch.long,
        )
        seqs = torch.zeros(size * (self.max_blocks + 1), dtype=torch.int32)
        seqs[: n * self.max_blocks] = padded_tables(batch.block_tables, self.max_blocks).view(-1)
        seqs[size * self.max_blocks : size * self.max_blocks + n] = torch.tensor(batch.seq_lens, dtype=torch.int32)
        self.token_inputs[:, :size].copy_(self._upload_tokens(tokens))
        if carried is not None:
            self.token_inputs[0].index_copy_(0, *carried)
        seqs = self._upload_seqs(seqs)
        self.block_tables[:size].view(-1).copy_(seqs[: size * self.max_blocks])
        self.seq_lens[:size].copy_(seqs[size * self.max_blocks :])
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]

    def _forward(self, size: int) -> torch.Tensor:
        return self.forward(self.token_inputs[0, :size], self.token_inputs[1, :size], self.metadata[size])
