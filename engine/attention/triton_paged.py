"""Paged attention through the Triton kernels (``engine.attention.triton_kernels``): the default on
CUDA. Keys and values are read in place from the block cache, decodes in one launch (split over
the context where the batch alone leaves the GPU idle), every prefill chunk of the step in one
more, earlier context and prefix hits included; no gather, no padding, no mask tensor.

A step's metadata is a handful of int32 tensors. The eager path builds them from the step's
lists; the CUDA-graph runner (``engine.cuda_graphs``) builds them once per batch bucket over its
static buffers (``decode_metadata``) and rewrites the buffers' contents before each replay, so a
padded row (slot -1, context 0) writes nothing and attends to nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, StepTensors
from engine.pinned_upload import PinnedUpload

# A decode program covers at least this many positions of one sequence's context when split.
_MIN_SPLIT_POSITIONS = 256
MAX_SPLITS = 16


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [T] the step's slots (< 0: a padding token, stored nowhere)
    num_decodes: int
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int32, 0 for a padding row
    num_splits: int = 1
    prefill_block_tables: torch.Tensor | None = None  # [chunks, max_blocks] int32
    prefill_query_start: torch.Tensor | None = None  # [chunks + 1] int32, rows after the decodes
    prefill_seq_lens: torch.Tensor | None = None  # [chunks] int32
    max_query_len: int = 0


def decode_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many programs share one sequence's context: enough for the batch's programs to fill the
    GPU's multiprocessors twice over, none covering less than ``_MIN_SPLIT_POSITIONS``."""
    if device.type != "cuda":
        return 1
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-programs // max(1, batch * num_kv_heads))
    worth = -(-max_context // _MIN_SPLIT_POSITIONS)
    return max(1, min(wanted, worth, MAX_SPLITS))


def padded_tables(tables: list[list[int]], width: int) -> torch.Tensor:
    """[rows, width] int32 on the host: each table cut or padded with block 0 (never read past a
    row's context) to ``width``."""
    return torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables], dtype=torch.int32)


class TritonPagedAttention(AttentionBackend):
    name = "triton"

    def __init__(self, num_kv_heads: int = 1) -> None:
        # Imported here, not with the module: the metadata and the graph runner's buffers need no
        # Triton, and a CPU install may have none.
        from engine.attention import triton_kernels

        self.kernels = triton_kernels
        self.num_kv_heads = num_kv_heads  # this shard's: how many programs a decode launch has
        self._upload: PinnedUpload | None = None

    def build_metadata(self, step: StepTensors, block_size: int) -> TritonAttentionMetadata:
        device = step.input_ids.device
        nd = step.num_decodes
        meta = TritonAttentionMetadata(slot_mapping=step.slot_mapping, num_decodes=nd)
        host: list[torch.Tensor] = []  # one host-to-device copy for all of them
        if nd:
            seq_lens = step.seq_lens[:nd]
            max_context = max(seq_lens)
            host += [padded_tables(step.block_tables[:nd], -(-max_context // block_size)).view(-1)]
            host += [torch.tensor(seq_lens, dtype=torch.int32)]
            meta.num_splits = decode_splits(nd, self.num_kv_heads, max_context, device)
        query_lens, seq_lens = step.query_lens[nd:], step.seq_lens[nd:]
        if query_lens:
            width = -(-max(seq_lens) // block_size)
            host += [padded_tables(step.block_tables[nd:], width).view(-1)]
            host += [torch.tensor(list(itertools.accumulate(query_lens, initial=0)), dtype=torch.int32)]
            host += [torch.tensor(seq_lens, dtype=torch.int32)]
            meta.max_query_len = max(query_lens)
        if not host:
            return meta
        if self._upload is None or self._upload.device != device:
            self._upload = PinnedUpload(device, torch.int32)
        flat = self._upload(torch.cat(host))
        parts = iter(torch.split(flat, [t.numel() for t in host]))
        if nd:
            meta.decode_block_tables = next(parts).view(nd, -1)
            meta.decode_seq_lens = next(parts)
        if query_lens:
            meta.prefill_block_tables = next(parts).view(len(query_lens), -1)
            meta.prefill_query_start = next(parts)
            meta.prefill_seq_lens = next(parts)
        return meta

    def forward(self, q, k, v, kv_cache, metadata, scale):
        assert isinstance(metadata, TritonAttentionMetadata)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self.kernels.store_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = metadata.num_decodes
        if nd:
            assert metadata.decode_block_tables is not None and metadata.decode_seq_lens is not None
            self.kernels.paged_decode_attention(
                q[:nd],
                key_cache,
                value_cache,
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
                scale,
                out[:nd],
                metadata.num_splits,
            )
        if metadata.prefill_seq_lens is not None:
            assert metadata.prefill_block_tables is not None and metadata.prefill_query_start is not None
            self.kernels.paged_prefill_attention(
                q[nd:],
                key_cache,
                value_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start,
                metadata.prefill_seq_lens,
                metadata.max_query_len,
                scale,
                out[nd:],
            )
        return out
