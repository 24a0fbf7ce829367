"""The compiled CPU kernels against the torch expressions they replace, on random inputs."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels as kernels_module
from engine.cpu_kernels import cpu_kernels
from engine.layers.rotary import _rotate_half

KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the engine runs plain torch ops")


@pytest.fixture(scope="module")
def portable():
    """The same sources built for a baseline x86-64 (no AVX): the code paths a CPU without AVX-512 runs."""
    compiler = kernels_module._compiler()
    assert compiler is not None
    return kernels_module.load(kernels_module.build(compiler, march="x86-64-v2"))


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def paged_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def reference_attention(query, key_cache, value_cache, table, context_len, scale):
    """query [rows, heads, dim] at the last ``rows`` of ``context_len`` positions, causal."""
    rows, _, dim = query.shape
    kv_heads = key_cache.shape[2]
    keys = key_cache[table].reshape(-1, kv_heads, dim)[:context_len].float()
    values = value_cache[table].reshape(-1, kv_heads, dim)[:context_len].float()
    positions = torch.arange(context_len - rows, context_len)
    mask = torch.arange(context_len)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    # GQA groups of 3 (one pass of three query heads over the values), 1, 8 (two of four), 4 (two
    # of two at head_dim 128) and 5 (four, then one); head_dim 64/32/16/128 (the register-held
    # accumulators of 4, 2, 1 and 8 vectors; 16 is too short for the bf16 pair dot); head_dim 96:
    # the bf16 pair dot with the plain value loop.
    [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 16), (8, 2, 128, 16), (10, 2, 32, 16), (6, 2, 96, 8)],
)
@pytest.mark.parametrize("many", [False, True])
@pytest.mark.parametrize("kernel", ["paged_attention", "prefill_attention"])
def test_paged_attention_matches_sdpa_over_gathered_blocks(dtype, heads, kv_heads, head_dim, block_size, many, kernel):
    # Sequences of 1 (decode) to many query rows, contexts crossing block edges, blocks out of order;
    # with ``many``, a decode batch's worth of them (each thread takes a run of consecutive items).
    # The prefill kernel's items are 16 rows: chunks of several row blocks, whole prompts (rows =
    # context) and later chunks reading earlier context, a row count no multiple of 16 or 4.
    shapes = [(1, 1), (1, block_size), (1, block_size + 1), (5, 37), (block_size, 3 * block_size), (1, 300)]
    if kernel == "prefill_attention":
        shapes += [(40, 40), (33, 33), (17, 290), (100, 131)]
    if many:
        shapes = shapes * 2 + [(1, 1 + 23 * i % 200) for i in range(40)]
    num_blocks = sum(-(-ctx // block_size) for _, ctx in shapes) + 3
    key_cache, value_cache = paged_cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed=heads)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    max_blocks = max(-(-ctx // block_size) for _, ctx in shapes)
    tables = torch.zeros(len(shapes), max_blocks, dtype=torch.int64)
    starts, tokens = [], 0
    for s, (rows, ctx) in enumerate(shapes):
        n = -(-ctx // block_size)
        tables[s, :n] = torch.tensor([order.pop() for _ in range(n)])
        starts.append(tokens)
        tokens += rows
    query = torch.randn(tokens, heads, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    getattr(KERNELS, kernel)(
        query,
        key_cache,
        value_cache,
        out,
        tables,
        torch.tensor(starts),
        torch.tensor([r for r, _ in shapes]),
        torch.tensor([c for _, c in shapes]),
        scale,
    )
    for s, (rows, ctx) in enumerate(shapes):
        n = -(-ctx // block_size)
        ref = reference_attention(
            query[starts[s] : starts[s] + rows], key_cache, value_cache, tables[s, :n], ctx, scale
        )
        got = out[starts[s] : starts[s] + rows].float()
        assert (got - ref).abs().max().item() < TOLERANCE[dtype], f"sequence {s} ({rows} rows, context {ctx})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["paged_attention", "prefill_attention"])
def test_slots_past_the_context_are_never_weighed(dtype, kernel):
    """A block's slots past a sequence's context hold whatever was there (NaN here): a weight of 0
    times NaN is NaN, so no kernel may let them into a sum (the bf16 prefill kernel packs zeros)."""
    key_cache, value_cache = paged_cache(4, 16, 3, 64, dtype, seed=5)
    key_cache[1, 5:], value_cache[1, 5:] = float("nan"), float("nan")  # context 21: block 1 holds 5
    query = torch.randn(21, 9, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    out = torch.empty_like(query)
    table = torch.tensor([[2, 1]])
    getattr(KERNELS, kernel)(
        query, key_cache, value_cache, out, table, torch.tensor([0]), torch.tensor([21]), torch.tensor([21]), 0.125
    )
    ref = reference_attention(query, key_cache, value_cache, table[0], 21, 0.125)
    assert (out.float() - ref).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("kernel", ["paged_attention", "prefill_attention"])
def test_paged_attention_reads_strided_query_rows(kernel):
    """Query heads may be a view into the fused qkv projection's output (rows strided)."""
    key_cache, value_cache = paged_cache(8, 16, 2, 32, torch.float32, seed=3)
    qkv = torch.randn(23, (4 + 2 * 2) * 32)
    query = qkv[:, : 4 * 32].view(23, 4, 32)
    assert not query.is_contiguous()
    tables = torch.tensor([[5, 1], [2, 7], [0, 3]])
    starts, rows, lens = torch.tensor([0, 1, 21]), torch.tensor([1, 20, 2]), torch.tensor([20, 32, 2])
    args = (key_cache, value_cache)
    strided, packed = torch.empty(23, 4, 32), torch.empty(23, 4, 32)
    getattr(KERNELS, kernel)(query, *args, strided, tables, starts, rows, lens, 0.2)
    getattr(KERNELS, kernel)(query.contiguous(), *args, packed, tables, starts, rows, lens, 0.2)
    assert torch.equal(strided, packed)


def torch_rms_norm(x, weight, eps):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_and_without_the_residual_add(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    delta = torch.randn(rows, 576, generator=g).to(dtype)
    weight = torch.rand(576, generator=g).to(dtype)
    plain = KERNELS.rms_norm(x.clone(), weight, 1e-5)
    torch.testing.assert_close(plain, torch_rms_norm(x, weight, 1e-5), atol=TOLERANCE[dtype], rtol=0)
    residual = x.clone()
    fused = KERNELS.rms_norm(residual, weight, 1e-5, residual_delta=delta)
    assert torch.equal(residual, x + delta)  # the add is the same op, to the bit
    torch.testing.assert_close(fused, torch_rms_norm(x + delta, weight, 1e-5), atol=TOLERANCE[dtype], rtol=0)


def test_bfloat16_denormal_results_flush_to_zero_only_with_native_bf16_rounding():
    """With AVX512_BF16 the kernels round through the CPU's conversion, which flushes results below
    bf16's smallest normal to zero (as oneDNN's bf16 products do); elsewhere they keep torch's."""
    x = torch.full((1, 64), 1e-39, dtype=torch.bfloat16)  # a bf16 denormal
    delta = torch.full((1, 64), 1e-40, dtype=torch.bfloat16)
    expected = x + delta
    KERNELS.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5, residual_delta=delta)
    if KERNELS.bf16_rounding_is_native:
        assert torch.equal(x, torch.zeros_like(x))
    else:
        assert torch.equal(x, expected) and expected.abs().min() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    gate_up = (torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 6).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = KERNELS.silu_and_mul(gate_up)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_is_bit_identical_to_the_torch_formula(dtype):
    tokens, heads, kv_heads, dim = 11, 9, 3, 64
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    cos = torch.randn(100, dim, generator=g).to(dtype)
    sin = torch.randn(100, dim, generator=g).to(dtype)
    positions = torch.randint(0, 100, (tokens,), generator=g)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected_q, expected_k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    KERNELS.rotary(q, k, cos, sin, positions)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    assert cpu_kernels.__wrapped__() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_portable_build_agrees_with_the_native_one(portable, dtype):
    g = torch.Generator().manual_seed(9)
    key_cache, value_cache = paged_cache(40, 16, 3, 64, dtype, seed=9)
    tables = torch.randperm(40, generator=g)[:36].view(4, 9).contiguous()
    query = torch.randn(7, 9, 64, generator=g).to(dtype)
    starts, lens, ctx = torch.tensor([0, 1, 2, 3]), torch.tensor([1, 1, 1, 4]), torch.tensor([1, 17, 140, 100])
    outs = []
    for kernels in (KERNELS, portable):
        out = torch.empty_like(query)
        kernels.paged_attention(query, key_cache, value_cache, out, tables, starts, lens, ctx, 0.125)
        outs.append(out.float())
    assert (outs[0] - outs[1]).abs().max().item() < TOLERANCE[dtype]
    # The tiled prefill kernel: two chunks, one reading earlier context (intrinsics natively,
    # compiler loops portably, both fused multiply-adds: the same sums).
    query = torch.randn(60, 9, 64, generator=g).to(dtype)
    starts, lens, ctx = torch.tensor([0, 37]), torch.tensor([37, 23]), torch.tensor([37, 140])
    outs = []
    for kernels in (KERNELS, portable):
        out = torch.empty_like(query)
        kernels.prefill_attention(query, key_cache, value_cache, out, tables[:2], starts, lens, ctx, 0.125)
        outs.append(out.float())
    assert (outs[0] - outs[1]).abs().max().item() < TOLERANCE[dtype]
    x = torch.randn(5, 576, generator=g).to(dtype)
    weight = torch.rand(576, generator=g).to(dtype)
    torch.testing.assert_close(
        KERNELS.rms_norm(x.clone(), weight, 1e-5),
        portable.rms_norm(x.clone(), weight, 1e-5),
        atol=TOLERANCE[dtype],
        rtol=0,
    )
    gate_up = torch.randn(5, 256, generator=g).to(dtype)
    torch.testing.assert_close(
        KERNELS.silu_and_mul(gate_up), portable.silu_and_mul(gate_up), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )
    # Widths that are no multiple of 16 (the AVX-512 paths' masked tails): SiLU to the bit for
    # finite inputs, RMSNorm within its reduction order.
    odd = (torch.randn(4, 2 * 37, generator=g) * 8).to(dtype)
    assert torch.equal(KERNELS.silu_and_mul(odd), portable.silu_and_mul(odd))
    x, delta = torch.randn(3, 37, generator=g).to(dtype), torch.randn(3, 37, generator=g).to(dtype)
    weight = torch.rand(37, generator=g).to(dtype)
    native_x, portable_x = x.clone(), x.clone()
    torch.testing.assert_close(
        KERNELS.rms_norm(native_x, weight, 1e-5, residual_delta=delta),
        portable.rms_norm(portable_x, weight, 1e-5, residual_delta=delta),
        atol=TOLERANCE[dtype],
        rtol=0,
    )
    assert torch.equal(native_x, portable_x)  # the residual add, to the bit
    # Rotary rounds op for op in both builds (AVX-512 intrinsics natively, compiler loops portably):
    # the same bits, a head_dim whose half is no multiple of 16 included.
    for dim in (64, 40):
        qk = torch.randn(6, 12, dim, generator=g).to(dtype)
        cos, sin = torch.randn(50, dim, generator=g).to(dtype), torch.randn(50, dim, generator=g).to(dtype)
        positions = torch.randint(0, 50, (6,), generator=g)
        native, other = qk.clone(), qk.clone()
        KERNELS.rotary(native[:, :9], native[:, 9:], cos, sin, positions)
        portable.rotary(other[:, :9], other[:, 9:], cos, sin, positions)
        assert torch.equal(native, other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy(dtype):
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(6, (4 + 2 * 2) * 32, generator=g).to(dtype)
    k = qkv[:, 4 * 32 : 6 * 32].view(6, 2, 32)
    v = qkv[:, 6 * 32 :].view(6, 2, 32)
    slots = torch.tensor([17, 3, 40, 41, 0, 63])
    key_cache, value_cache = paged_cache(4, 16, 2, 32, dtype, seed=4)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    expected_k.view(-1, 2, 32).index_copy_(0, slots, k)
    expected_v.view(-1, 2, 32).index_copy_(0, slots, v)
    KERNELS.write_kv(k, v, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_the_prefill_probe_times_both_paths_and_a_pin_overrides_it(monkeypatch):
    from engine.cpu_kernels import prefill_probe

    probe = prefill_probe._probe(KERNELS, torch.float32, 9, 3, 64)
    assert probe.tiled_s > 0 and probe.sdpa_s > 0
    assert prefill_probe.PrefillProbe(1.0, 1.0).tiled_wins is False  # a tie keeps torch's path
    assert prefill_probe.PrefillProbe(1.0, 2.0).tiled_wins is True
    for pinned, expected in (("sdpa", False), ("tiled", True)):
        monkeypatch.setenv("PDSERVE_PREFILL_ATTENTION", pinned)
        prefill_probe.use_tiled_prefill.cache_clear()
        assert prefill_probe.use_tiled_prefill(KERNELS, torch.float32, 9, 3, 64) is expected
    prefill_probe.use_tiled_prefill.cache_clear()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISAs")
def test_the_kernels_follow_torchs_isa_so_one_variable_emulates_an_avx2_machine(tmp_path):
    """With torch held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``, as on our AVX2-only machines), the
    kernels are built without AVX-512 as well: no native bf16 rounding, whatever this CPU has."""
    probe = (
        "import torch; from engine.cpu_kernels import cpu_kernels; k = cpu_kernels(); "
        "print(torch.backends.cpu.get_cpu_capability(), k is not None and k.bf16_rounding_is_native)"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PDSERVE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["AVX2", "False"]
    (built,) = (tmp_path / "kernels").glob("*.so")
    if shutil.which("objdump"):  # binutils comes with the compiler the kernels need, but check
        assert b"vcvtneps2bf16" not in subprocess.run(["objdump", "-d", str(built)], capture_output=True).stdout
