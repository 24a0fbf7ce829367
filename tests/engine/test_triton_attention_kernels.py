"""The Triton paged-attention kernels against plain torch attention over the gathered blocks.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 must be
set before the kernel module is imported); with one they run compiled on it. Shapes stay small:
the interpreter runs every program one by one in numpy.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.attention.triton_kernels import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)

BLOCK_SIZE = 16
# (query heads, KV heads, head_dim): GQA 1, 3 (SmolLM2's shape) and 4, and a head_dim that is
# not a power of two (masked).
SHAPES = [(4, 4, 32), (9, 3, 64), (8, 2, 32), (4, 2, 48)]
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tables(seq_lens: list[int], block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables [S, max_blocks] int32 whose blocks are scattered out of order over the cache
    (block 0 left unused), and the number of blocks the cache needs."""
    counts = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(max(counts), 1)
    num_blocks = sum(counts) + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for s, n in enumerate(counts):
        tables[s, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
    return tables, num_blocks


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table.long()[positions // block_size] * block_size + positions % block_size


def _reference(q, key_cache, value_cache, table, seq_len, scale) -> torch.Tensor:
    """q [n, Hq, D], the last n positions of a context of seq_len, against the context's gathered
    keys/values, causal from the end; float32 [n, Hq, D]."""
    n, num_heads = q.shape[:2]
    slots = _slots(table, torch.arange(seq_len), key_cache.shape[1])
    group = num_heads // key_cache.shape[2]
    keys = key_cache.reshape(-1, *key_cache.shape[2:])[slots].float().repeat_interleave(group, dim=1)
    values = value_cache.reshape(-1, *value_cache.shape[2:])[slots].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    allowed = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - n, seq_len)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def _cache(num_blocks: int, num_kv_heads: int, head_dim: int, dtype, gen, block_size: int = BLOCK_SIZE):
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    return kv[0], kv[1]


def _decode(q, key_cache, value_cache, tables, seq_lens, scale, num_splits):
    out = torch.full_like(q, float("nan"), device=DEVICE)
    args = (key_cache, value_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), scale)
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    paged_decode_attention(q.to(DEVICE), *args, out, num_splits=num_splits)
    return out.cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, dtype, num_splits):
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim)
    # A whole block, one past it, a padding row, a partial block, a longer context.
    seq_lens = [16, 17, 0, 5, 70]
    tables, num_blocks = _tables(seq_lens, BLOCK_SIZE, gen)
    key_cache, value_cache = _cache(num_blocks, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5

    out = _decode(q, key_cache, value_cache, tables, seq_lens, scale, num_splits)

    assert out.dtype == dtype
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])), "a padding row must be zeros"
            continue
        expected = _reference(q[b : b + 1], key_cache, value_cache, tables[b], n, scale)[0]
        torch.testing.assert_close(out[b].float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [16, 128])
def test_split_decode_equals_one_split_over_a_long_context(block_size):
    gen = torch.Generator().manual_seed(block_size)
    seq_lens = [300, 129, 1]
    tables, num_blocks = _tables(seq_lens, block_size, gen)
    key_cache, value_cache = _cache(num_blocks, 3, 64, torch.float32, gen, block_size)
    q = torch.randn(len(seq_lens), 9, 64, generator=gen)

    whole = _decode(q, key_cache, value_cache, tables, seq_lens, 0.125, 1)
    # Splits take whole tiles: 300 tokens in 4 splits are 128 + 128 + 44 + an empty one; the
    # 1-token row leaves every split but the first empty.
    for num_splits in (4, 7):
        split = _decode(q, key_cache, value_cache, tables, seq_lens, 0.125, num_splits)
        torch.testing.assert_close(split, whole, atol=2e-6, rtol=2e-6)
    for b, n in enumerate(seq_lens):
        expected = _reference(q[b : b + 1], key_cache, value_cache, tables[b], n, 0.125)[0]
        torch.testing.assert_close(whole[b], expected, **TOLERANCE[torch.float32])


def test_decode_reads_the_blocks_the_table_names():
    """The comparisons above can fail: a table shifted by one block gives another answer."""
    gen = torch.Generator().manual_seed(7)
    seq_lens = [40]
    tables, num_blocks = _tables(seq_lens, BLOCK_SIZE, gen)
    key_cache, value_cache = _cache(num_blocks, 3, 64, torch.float32, gen)
    q = torch.randn(1, 9, 64, generator=gen)
    expected = _reference(q, key_cache, value_cache, tables[0], 40, 0.125)[0]
    shifted = torch.roll(tables, 1, dims=1)
    out = _decode(q, key_cache, value_cache, shifted, seq_lens, 0.125, 1)
    assert not torch.allclose(out[0], expected, atol=1e-3)
    shorter = _decode(q, key_cache, value_cache, tables, [39], 0.125, 1)
    assert not torch.allclose(shorter[0], expected, atol=1e-3)


def _prefill(q, key_cache, value_cache, tables, query_lens, seq_lens, scale):
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    paged_prefill_attention(
        q.to(DEVICE),
        key_cache,
        value_cache,
        tables.to(DEVICE),
        starts.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        max(query_lens),
        scale,
        out,
    )
    return out.cpu(), starts.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_prefill_matches_reference(num_heads, num_kv_heads, head_dim, dtype):
    """Each chunk's own keys/values go in through store_kv; earlier context is already cached."""
    gen = torch.Generator().manual_seed(num_heads * 10 + head_dim)
    # (chunk, context after it): from position 0; a chunk crossing a block after a partial one;
    # a whole block after a whole block; one token one past a block; a chunk over two query tiles
    # (for a group of 3 or more: a tile holds 64 // group query tokens).
    chunks = [(5, 5), (3, 19), (16, 32), (1, 17), (30, 45)]
    query_lens, seq_lens = [c for c, _ in chunks], [n for _, n in chunks]
    tables, num_blocks = _tables(seq_lens, BLOCK_SIZE, gen)
    key_cache, value_cache = _cache(num_blocks, num_kv_heads, head_dim, dtype, gen)
    key_cache, value_cache = key_cache.to(DEVICE), value_cache.to(DEVICE)
    total = sum(query_lens)
    # The chunk's K/V as views split from a fused qkv projection: strided rows.
    qkv = torch.randn(total, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    positions = torch.cat([torch.arange(n - c, n) for c, n in chunks])
    seq_ids = torch.cat([torch.full((c,), s) for s, (c, _) in enumerate(chunks)])
    slots = torch.stack([_slots(tables[s], p[None], BLOCK_SIZE)[0] for s, p in zip(seq_ids, positions, strict=True)])
    store_kv(k.to(DEVICE), v.to(DEVICE), key_cache, value_cache, slots.to(DEVICE))
    key_cache, value_cache = key_cache.cpu(), value_cache.cpu()
    assert torch.equal(key_cache.view(-1, num_kv_heads, head_dim)[slots], k)
    assert torch.equal(value_cache.view(-1, num_kv_heads, head_dim)[slots], v)
    scale = head_dim**-0.5

    out, starts = _prefill(q, key_cache.to(DEVICE), value_cache.to(DEVICE), tables, query_lens, seq_lens, scale)

    for s, (c, n) in enumerate(chunks):
        rows = slice(starts[s], starts[s] + c)
        expected = _reference(q[rows], key_cache, value_cache, tables[s], n, scale)
        torch.testing.assert_close(out[rows].float(), expected, **TOLERANCE[dtype])


def test_prefill_is_causal_from_the_chunk_end():
    """Can fail: the same queries read as the context's first positions (top-left causal), or
    through a shifted table, give other answers; a sequence with an empty chunk writes nothing."""
    gen = torch.Generator().manual_seed(3)
    query_lens, seq_lens = [6, 0], [21, 4]
    tables, num_blocks = _tables(seq_lens, BLOCK_SIZE, gen)
    key_cache, value_cache = _cache(num_blocks, 2, 32, torch.float32, gen)
    q = torch.randn(6, 8, 32, generator=gen)
    expected = _reference(q, key_cache, value_cache, tables[0], 21, 0.2)
    out, _ = _prefill(q, key_cache.to(DEVICE), value_cache.to(DEVICE), tables, query_lens, seq_lens, 0.2)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    top_left, _ = _prefill(q, key_cache.to(DEVICE), value_cache.to(DEVICE), tables, query_lens, [6, 4], 0.2)
    assert not torch.allclose(top_left, expected, atol=1e-3)
    shifted, _ = _prefill(q, key_cache.to(DEVICE), value_cache.to(DEVICE), tables.roll(1, 1), query_lens, seq_lens, 0.2)
    assert not torch.allclose(shifted, expected, atol=1e-3)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_writes_slots_and_skips_padding(slot_dtype):
    gen = torch.Generator().manual_seed(11)
    num_blocks, num_kv_heads, head_dim = 4, 3, 64
    key_cache, value_cache = (torch.zeros(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim) for _ in range(2))
    qkv = torch.randn(5, 9 + 2 * num_kv_heads, head_dim, generator=gen)
    _, k, v = qkv.split([9, num_kv_heads, num_kv_heads], dim=1)  # strided views
    slots = torch.tensor([17, -1, 0, 63, -1], dtype=slot_dtype)
    key_cache, value_cache = key_cache.to(DEVICE), value_cache.to(DEVICE)
    store_kv(k.to(DEVICE), v.to(DEVICE), key_cache, value_cache, slots.to(DEVICE))

    expected_k, expected_v = (torch.zeros(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim) for _ in range(2))
    real = slots >= 0
    expected_k[slots[real].long()] = k[real]
    expected_v[slots[real].long()] = v[real]
    assert torch.equal(key_cache.cpu().view(-1, num_kv_heads, head_dim), expected_k)
    assert torch.equal(value_cache.cpu().view(-1, num_kv_heads, head_dim), expected_v)
    assert key_cache.count_nonzero() == 3 * num_kv_heads * head_dim  # nothing but the three real slots


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_split_decode_replays_in_a_cuda_graph():
    """No host sync in the launcher: captured once, replayed after the inputs changed in place."""
    gen = torch.Generator().manual_seed(5)
    seq_lens = [100, 33]
    tables, num_blocks = _tables([200, 200], BLOCK_SIZE, gen)
    key_cache, value_cache = (c.cuda() for c in _cache(num_blocks, 2, 64, torch.bfloat16, gen))
    q = torch.randn(2, 8, 64, generator=gen).to(torch.bfloat16).cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    tables_dev, out = tables.cuda(), torch.empty_like(q)
    paged_decode_attention(q, key_cache, value_cache, tables_dev, lens, 0.125, out, num_splits=4)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, key_cache, value_cache, tables_dev, lens, 0.125, out, num_splits=4)
    lens.copy_(torch.tensor([150, 0], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    expected = _reference(q[:1].cpu(), key_cache.cpu(), value_cache.cpu(), tables[0], 150, 0.125)[0]
    torch.testing.assert_close(out[0].float().cpu(), expected, **TOLERANCE[torch.bfloat16])
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))
