"""Paged attention in torch: runs on CPU (what CI tests) and, slowly but correctly, on CUDA.

Decodes are batched. On CPU they run in one call of the compiled kernel
(``engine/cpu_kernels/paged_attention.c``), which reads each sequence's keys and values where they lie in the
paged cache: ``build_metadata`` binds it to the step's tables (``decode_attention``) and the CPU
layer loop (``engine.models.llama_cpu``) calls it. Elsewhere (CUDA, or no C compiler) ``forward``
gathers every decode sequence's blocks into one padded [batch, max_context, heads, head_dim]
tensor and masks it past each sequence's length.
On CPU with the kernels, a step's prefill chunks go through the tiled prefill kernel
(``engine/cpu_kernels/prefill_attention.c``) in one call, keys and values read in place from the
cache (``prefill_attention``). Elsewhere they go one by one through SDPA with a batch dimension
(a 4-D call takes torch's flash kernel on CPU; a 3-D one fell back to the math path, 3-4x
slower); a chunk starting at position 0 attends to its own keys (causal, no cache read, the same
call transformers makes), a later chunk reads its earlier context from the cache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata, StepTensors
from engine.cpu_kernels import DecodeAttention, PrefillAttention, kernels_for


@dataclass
class _Prefill:
    token_start: int
    num_tokens: int
    context_len: int
    block_table: torch.Tensor | None = None  # only when the chunk has earlier context
    mask: torch.Tensor | None = None  # [num_tokens, context_len] True = attend


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    # [num_decodes, 1, 1, max_blocks * block_size]: True past each sequence's end, and its inverse
    decode_padding: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    # CPU with the compiled kernels: the decodes' attention bound to this step's tables once.
    decode_attention: DecodeAttention | None = None
    # ... and the prefill chunks', for the tiled kernel (every chunk in one call a layer).
    prefill_attention: PrefillAttention | None = None
    prefills: list[_Prefill] = field(default_factory=list)


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def __init__(self, cpu_kernels: bool = True, tiled_prefill: bool = True) -> None:
        # False: the decodes get the plain path's masks, not the kernel's tables (``compile: false``).
        self.cpu_kernels = cpu_kernels
        # With the kernels: prefill chunks through the tiled kernel, else SDPA (the faster on this
        # machine: engine.cpu_kernels.prefill_probe).
        self.tiled_prefill = tiled_prefill

    def build_metadata(self, step: StepTensors, block_size: int) -> TorchAttentionMetadata:
        device = step.input_ids.device
        meta = TorchAttentionMetadata(slot_mapping=step.slot_mapping, num_decodes=step.num_decodes)
        kernels = kernels_for(device) if self.cpu_kernels else None
        nd = step.num_decodes
        if nd:
            seq_lens = step.seq_lens[:nd]
            max_blocks = -(-max(seq_lens) // block_size)
            meta.decode_block_tables = _padded_tables(step.block_tables[:nd], max_blocks).to(device)
            if kernels is not None:
                context_lens = torch.tensor(seq_lens, dtype=torch.long)
                meta.decode_attention = DecodeAttention(meta.decode_block_tables, context_lens)
            else:
                lens = torch.tensor(seq_lens, device=device)
                span = torch.arange(max_blocks * block_size, device=device)
                meta.decode_padding = (span[None, :] >= lens[:, None])[:, None, None, :]
                meta.decode_mask = ~meta.decode_padding
        tiled = kernels is not None and self.tiled_prefill
        start = nd
        prefill_seqs = zip(step.query_lens[nd:], step.seq_lens[nd:], step.block_tables[nd:], strict=True)
        for q_len, seq_len, table in prefill_seqs:
            prefill = _Prefill(token_start=start, num_tokens=q_len, context_len=seq_len)
            if seq_len > q_len and not tiled:
                num_blocks = -(-seq_len // block_size)
                prefill.block_table = torch.tensor(table[:num_blocks], dtype=torch.long, device=device)
                if device.type == "cpu":  # CPU SDPA's flash kernel takes a boolean mask (64 MB at 2k x 32k)
                    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                    prefill.mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
            meta.prefills.append(prefill)
            start += q_len
        if tiled and meta.prefills:
            meta.prefill_attention = _bind_prefills(step, block_size)
        return meta

    def forward(self, q, k, v, kv_cache, metadata, scale):
        """The plain torch path (CUDA, or no C compiler). With the CPU kernels the model runs
        ``engine.models.llama_cpu``, which writes the cache and attends to decodes in the kernels
        (``metadata.decode_attention``) and shares ``attend_prefills`` with this path."""
        assert isinstance(metadata, TorchAttentionMetadata)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, metadata, scale)
        attend_prefills(q, k, v, key_cache, value_cache, metadata, scale, out)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        """One query token per sequence against its gathered blocks.

        float32 uses SDPA (what transformers runs, and it reads the strided gather without a copy).
        Reduced precision uses two batched matmuls with a float32 softmax: CPU SDPA is slow there
        (measured per layer at batch 64, context 256: 8.1 ms in SDPA vs 0.7 ms; engine decode step
        450 ms -> 210 ms for SmolLM2 bf16 at batch 64).
        """
        batch, num_heads, head_dim = q.shape
        kv = kv_cache[:, meta.decode_block_tables]  # [2, batch, max_blocks, block_size, kv_heads, head_dim]
        num_kv_heads = kv.shape[-2]
        keys = kv[0].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)  # [batch, kv_heads, ctx, head_dim]
        values = kv[1].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        if q.dtype == torch.float32:
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
            )
            return out.squeeze(2)
        # Query heads h * group .. h * group + group - 1 share KV head h (Hugging Face's repeat_kv order).
        grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale
        scores.masked_fill_(meta.decode_padding, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, values).view(batch, num_heads, head_dim)


def _padded_tables(tables: list[list[int]], max_blocks: int) -> torch.Tensor:
    """[sequences, max_blocks] int64 on CPU: each table cut or padded with block 0 to max_blocks."""
    return torch.tensor([t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in tables], dtype=torch.long)


def _bind_prefills(step: StepTensors, block_size: int) -> PrefillAttention:
    nd = step.num_decodes
    query_lens, seq_lens = step.query_lens[nd:], step.seq_lens[nd:]
    starts = list(itertools.accumulate(query_lens[:-1], initial=nd))  # the chunks' first rows
    return PrefillAttention(
        _padded_tables(step.block_tables[nd:], -(-max(seq_lens) // block_size)),
        torch.tensor(starts, dtype=torch.long),
        torch.tensor(query_lens, dtype=torch.long),
        torch.tensor(seq_lens, dtype=torch.long),
    )


def attend_prefills(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: TorchAttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Each prefill chunk of the step through SDPA into its rows of ``out`` [T, Hq, D]; k/v [T,
    Hkv, D] are the step's own keys and values, already written to the caches."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    for p in meta.prefills:
        s, n = p.token_start, p.num_tokens
        # [1, heads, tokens, head_dim]: with a batch dimension CPU SDPA takes its flash kernel.
        query = q[s : s + n].transpose(0, 1).unsqueeze(0)
        if p.block_table is None:
            o = F.scaled_dot_product_attention(
                query,
                k[s : s + n].transpose(0, 1).unsqueeze(0),
                v[s : s + n].transpose(0, 1).unsqueeze(0),
                is_causal=n > 1,
                scale=scale,
                enable_gqa=True,
            )
        else:
            keys = key_cache[p.block_table].view(-1, num_kv_heads, head_dim)[: p.context_len]
            values = value_cache[p.block_table].view(-1, num_kv_heads, head_dim)[: p.context_len]
            keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
            o = attend_after_context(query, keys, values, p.context_len, p.mask, scale)
        out[s : s + n] = o[0].transpose(0, 1)


def attend_after_context(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    context_len: int,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """A prefill chunk's query [1, Hq, n, D] against its whole context's keys/values [1, Hkv,
    context_len, D], causal from the chunk's end. With a boolean mask (CPU, whose flash kernel
    takes one) as it is. Without (CUDA): a mask together with enable_gqa sends CUDA's SDPA to its
    math path, which materialises [Hq, n, context] scores (for an 8B model a 2,048-token chunk at
    32k context, ~17 GB a layer), so K/V are expanded to the query heads (Hq x context x D, ~0.5 GB
    there) and the causal offset goes as a lower-right causal bias, which the flash and
    memory-efficient kernels take without a mask tensor."""
    if mask is not None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    # Imported here: torch.nn.attention.bias imports torch._dynamo, ~3 s of every engine process's
    # start on CPU, where this path never runs.
    from torch.nn.attention.bias import causal_lower_right

    group = query.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    bias = causal_lower_right(query.shape[2], context_len)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=bias, scale=scale)
