"""Paged attention in Triton over the layout of ``common.kv_layout``: the GPU kernels of the engine.

Three launchers, each one kernel launch (two for split decode) whose grid depends only on shapes
and int arguments: no host synchronisation, so a step can be captured in a CUDA graph.

    store_kv                 the step's new keys/values into their slots (slot < 0: a padding token)
    paged_decode_attention   one query token a sequence; optionally split across programs along the
                             context (flash-decoding) and combined by a small reduce kernel
    paged_prefill_attention  variable-length prefill chunks, causal from each chunk's end, earlier
                             context read through the block table (flash-attention's online softmax)

Keys and values are read where they lie in the cache. A program gathers a tile of positions::

    position p ──► block_tables[seq, p // block_size] = block id ──► cache[block, p % block_size, kv_head, :]

GQA: query heads ``h * group .. h * group + group - 1`` share KV head ``h`` (Hugging Face's
repeat_kv order), and one program takes a KV head's whole group so each K/V tile is read once per
group. In decode the group's query rows are padded to 16, the smallest ``tl.dot`` takes; in
prefill the rows of a tile are (query token, head of the group) pairs::

    row r of a prefill tile ──► query token q_block * BLOCK_Q + r // group, head kv_head * group + r % group

Scores and softmax are float32 (exp2 with log2(e) folded into the scale), the output in q's dtype.
``tl.dot`` runs with ``input_precision="ieee"``: float32 models must not round through TF32 (it is
ignored for half types). Supported: float32, float16, bfloat16; any head_dim from 16 to 256 (a
non-power of two is masked). Offsets into the cache are int64: a large cache passes 2**31 elements.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = math.log2(math.e)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in float32. UPCAST (on CPU, i.e. Triton's interpreter, which stores
    bfloat16 as uint16 and would multiply the bit patterns) converts the operands first: exact."""
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _store_kv_kernel(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # A padding token (slot < 0) has no heads to store: the mask, not a branch, keeps it out.
    stored_heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (heads[:, None] < stored_heads) & (dims[None, :] < head_dim)
    safe_slot = tl.maximum(slot, 0)
    dst = (safe_slot // block_size) * stride_cb + (safe_slot % block_size) * stride_cs
    dst += heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(key + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(key_cache + dst, k, mask=mask)
    tl.store(value_cache + dst, v, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] into key_cache/value_cache [num_blocks, block_size, Hkv, D] (a layer's
    ``kv[0]``, ``kv[1]``) at slot_mapping [T] (int32/int64); a slot < 0 writes nothing."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and key_cache.shape == value_cache.shape, "key/value shapes differ"
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), f"cache {tuple(key_cache.shape)} vs key {key.shape}"
    assert key.stride(2) == 1 and value.stride(2) == 1, "head vectors must be contiguous"
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1, "caches must share a layout"
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _decode_kernel(
    q,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    out,
    mid_out,
    mid_lse,
    qk_scale,
    block_size,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    num_heads,
    head_dim,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dim_mask = dims < head_dim
    qv = tl.load(
        q + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    # Each split takes a whole number of tiles; a padding row (seq_len 0) runs no iteration.
    seq_len = tl.load(seq_lens + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables + seq * stride_bt
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        block = tl.load(table + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
        src = block * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache + src[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache + src[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = _dot(qv, tl.trans(k), UPCAST) * qk_scale
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    safe_l = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / safe_l[:, None]
    store_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            result.to(out.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # Partial result, normalised, and its log2-sum-exp (-inf for an empty split); scratch
        # is contiguous: mid_lse [B, Hq, NUM_SPLITS], mid_out [B, Hq, NUM_SPLITS, head_dim].
        index = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(mid_out + index[:, None] * head_dim + dims[None, :], result, mask=store_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(safe_l))
        tl.store(mid_lse + index, lse, mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    mid_out,
    mid_lse,
    out,
    stride_ob,
    stride_oh,
    num_heads,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < NUM_SPLITS
    dim_mask = dims < head_dim
    index = (seq * num_heads + head) * NUM_SPLITS + splits
    lse = tl.load(mid_lse + index, mask=split_mask, other=float("-inf"))
    partial = tl.load(
        mid_out + index[:, None] * head_dim + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    # Every split empty (a padding row): max is -inf, weights all 0, the output 0.
    m = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(weights, 0)
    result = tl.sum(partial * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out + seq * stride_ob + head * stride_oh + dims, result.to(out.dtype.element_ty), mask=dim_mask)


def _check_cache(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int]:
    """(num_kv_heads, group) after checking the shapes the kernels assume."""
    num_heads, head_dim = q.shape[-2:]
    num_kv_heads = key_cache.shape[2]
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride(), "K/V caches differ"
    assert key_cache.shape[3] == head_dim and key_cache.stride(3) == 1, f"cache {tuple(key_cache.shape)}, q {q.shape}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    assert 16 <= head_dim <= 256 and q.stride(-1) == 1, f"head_dim {head_dim} unsupported (16..256, contiguous)"
    return num_kv_heads, num_heads // num_kv_heads


def _tiles(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N): a 256-wide head halves the KV tile to stay within registers."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return block_d, 64 if block_d <= 128 else 32


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int = 1,
) -> torch.Tensor:
    """q [B, Hq, D], one token a sequence, against positions 0 .. seq_lens[b] - 1 (its own K/V
    already stored); block_tables [B, max_blocks] int32; seq_lens [B] int32 (0: a padding row,
    written as zeros). ``num_splits`` > 1 spreads a sequence's context over that many programs
    (worth it when B * Hkv programs leave the GPU idle). Writes ``out`` [B, Hq, D] and returns it."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, group = _check_cache(q, key_cache, value_cache)
    assert out.shape == q.shape and out.stride(2) == 1, f"out {tuple(out.shape)} vs q {tuple(q.shape)}"
    assert num_splits >= 1, f"num_splits={num_splits}"
    if batch == 0:
        return out
    block_d, block_n = _tiles(head_dim)
    if num_splits > 1:
        mid_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        mid_out = mid_lse = out  # unused: the kernel writes the result straight to out
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        mid_out,
        mid_lse,
        scale * _LOG2E,
        key_cache.shape[1],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        head_dim,
        GROUP=group,
        NUM_SPLITS=num_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        UPCAST=q.device.type == "cpu",
        num_warps=4,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            mid_out,
            mid_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


@triton.jit
def _prefill_kernel(
    q,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    out,
    qk_scale,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    first_pos = seq_len - q_len  # position of the chunk's first query token

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    query = q_block * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows // GROUP < BLOCK_Q) & (query < q_len)
    dim_mask = dims < head_dim
    io_mask = row_mask[:, None] & dim_mask[None, :]
    token = (q_start + query).to(tl.int64)
    qv = tl.load(q + token[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0)
    query_pos = first_pos + query

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables + seq * stride_bt
    # The tile's last query attends up to its own position; nothing later is read. Every valid
    # row sees position 0 in the first tile, so its running max is finite from then on.
    end = tl.minimum(first_pos + (q_block + 1) * BLOCK_Q, seq_len)
    for tile in range(0, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        block = tl.load(table + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
        src = block * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache + src[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache + src[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = _dot(qv, tl.trans(k), UPCAST) * qk_scale
        causal = pos_mask[None, :] & (pos[None, :] <= query_pos[:, None])
        scores = tl.where(causal, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out + token[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        result.to(out.dtype.element_ty),
        mask=io_mask,
    )


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """q [T, Hq, D]: S chunks back to back, chunk s in rows query_start_loc[s] ..
    query_start_loc[s + 1] - 1 (query_start_loc [S + 1] int32); seq_lens [S] int32 is each
    sequence's context after its chunk, whose own K/V are already stored. Query i of a chunk of
    length n sits at position seq_len - n + i and attends to positions 0 .. that. block_tables
    [S, max_blocks] int32; max_query_len (a host int, at least the longest chunk) sizes the grid
    only. Writes ``out`` [T, Hq, D] and returns it."""
    head_dim = q.shape[2]
    num_kv_heads, group = _check_cache(q, key_cache, value_cache)
    assert out.shape == q.shape and out.stride(2) == 1, f"out {tuple(out.shape)} vs q {tuple(q.shape)}"
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape[0] == num_seqs + 1, "query_start_loc needs one entry more than seq_lens"
    if num_seqs == 0 or max_query_len <= 0:
        return out
    block_d, block_n = _tiles(head_dim)
    block_m = max(64, triton.next_power_of_2(group))  # rows: BLOCK_Q query tokens times the group
    block_q = block_m // group
    _prefill_kernel[(triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)](
        q,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * _LOG2E,
        key_cache.shape[1],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        head_dim,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        UPCAST=q.device.type == "cpu",
        num_warps=4 if block_d <= 128 else 8,
    )
    return out
