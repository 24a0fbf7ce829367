"""Fused elementwise kernels in Triton for the GPU layer path: each replaces a chain of small torch
ops (a launch and a pass over memory each) with one launch.

    fused_add_rms_norm  the residual add and RMSNorm of ``engine.layers.norm.RMSNorm.forward``
    rotary_inplace      ``engine.layers.rotary.apply_rotary`` on q and k in place
    silu_and_mul        ``F.silu(gate) * up`` of ``engine.models.llama.LlamaMLP``

Each kernel rounds where its torch reference rounds (to the model dtype after every op the
reference runs in that dtype) and computes in float32 in between; rotary and RMSNorm are built
without FMA contraction (``enable_fp_fusion=False``) so float32, too, rounds op by op as torch
does. In the interpreter bfloat16 comes out bit for bit, float32 rotary too, float32 RMSNorm and
SiLU within an ulp or two (reduction order, exp): float32 greedy output must stay
token-identical to transformers. Values become float32 before any arithmetic, which Triton's CPU
interpreter needs as well (it stores bfloat16 as raw uint16 and would compute on the bits).
Supported dtypes: float32, float16, bfloat16. The grids depend on shapes only, so the launchers
can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 -> dtype -> float32: the rounding of a torch op computed in dtype (to nearest, ties
    to even). bfloat16 rounds on the bits: the interpreter's own conversion truncates, and the
    same code then runs in the tests and on the GPU (NaN payloads aside)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """float32 -> dtype, rounded to nearest even (the interpreter would truncate bfloat16)."""
    return _round(x, dtype).to(dtype)


@triton.jit
def _add_rms_norm_kernel(
    x,
    delta,
    weight,
    out,
    stride_x,
    stride_delta,
    stride_out,
    hidden,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype: tl.constexpr = x.dtype.element_ty
    xv = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        xv = _round(xv + tl.load(delta + row * stride_delta + cols, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(x + row * stride_x + cols, _cast(xv, dtype), mask=mask)
    variance = tl.sum(xv * xv, 0) / hidden
    normed = _round(xv * tl.math.rsqrt(variance + eps), dtype)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_out + cols, _cast(w * normed, dtype), mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor, residual_delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm.forward: ``x += residual_delta`` in place (x is the residual stream) when given, then
    ``weight * (x * rsqrt(mean(x**2) + eps))`` over the last dimension as a new tensor."""
    hidden = x.shape[-1]
    rows = x.view(-1, hidden)  # a view, so the in-place add lands in x
    assert rows.stride(1) == 1, "x's last dimension must be contiguous"
    assert weight.shape == (hidden,) and weight.is_contiguous(), f"weight {tuple(weight.shape)} for hidden {hidden}"
    delta = rows if residual_delta is None else residual_delta.reshape(-1, hidden)
    assert delta.shape == rows.shape and delta.stride(1) == 1, f"residual_delta {tuple(delta.shape)} vs x {x.shape}"
    out = torch.empty_like(rows)
    if rows.shape[0] == 0:
        return out.view(x.shape)
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(rows.shape[0],)](
        rows,
        delta,
        weight,
        out,
        rows.stride(0),
        delta.stride(0),
        out.stride(0),
        hidden,
        eps,
        HAS_DELTA=residual_delta is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
        enable_fp_fusion=False,
    )
    return out.view(x.shape)


@triton.jit
def _rotate_heads(
    ptr,
    stride_h,
    num_heads,
    half,
    cos1,
    cos2,
    sin1,
    sin2,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One token's heads in place: (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin), rounded like
    the reference's ``x * cos + rotate_half(x) * sin`` in the model dtype."""
    dtype: tl.constexpr = ptr.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < half)
    first = ptr + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    out1 = _round(x1 * cos1[None, :], dtype) - _round(x2 * sin1[None, :], dtype)
    out2 = _round(x2 * cos2[None, :], dtype) + _round(x1 * sin2[None, :], dtype)
    tl.store(first, _cast(out1, dtype), mask=mask)
    tl.store(first + half, _cast(out2, dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q,
    k,
    positions,
    cos,
    sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_kv_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    mask = cols < half
    # The tables hold both halves (cat(freqs, freqs)); read both rather than assume it.
    cos1 = tl.load(cos + pos * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos + pos * stride_cos + half + cols, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin + pos * stride_sin + cols, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin + pos * stride_sin + half + cols, mask=mask, other=0.0).to(tl.float32)
    _rotate_heads(q + token * stride_qt, stride_qh, num_q_heads, half, cos1, cos2, sin1, sin2, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k + token * stride_kt, stride_kh, num_kv_heads, half, cos1, cos2, sin1, sin2, BLOCK_HK, BLOCK_HALF)


def rotary_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
) -> None:
    """Rotary embedding (Hugging Face's non-interleaved rotate-half form) in place on q [T, Hq, D]
    and k [T, Hkv, D], which may be strided views of a fused qkv tensor; cos/sin tables
    [max_positions, D] in the model dtype, rows gathered by positions [T] (int32/int64)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0, f"q {q.shape}, k {k.shape}"
    assert q.stride(2) == 1 and k.stride(2) == 1, "head vectors must be contiguous"
    assert cos_table.shape[1] == head_dim and cos_table.stride(1) == 1 and sin_table.stride(1) == 1, "tables"
    assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)} for {num_tokens} tokens"
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_table,
        sin_table,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_table.stride(0),
        sin_table.stride(0),
        num_q_heads,
        num_kv_heads,
        head_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        enable_fp_fusion=False,  # x1 * cos - x2 * sin as three rounded ops, no FMA: torch's rounding
    )


@triton.jit
def _silu_and_mul_kernel(gate_up, out, stride_in, stride_out, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype: tl.constexpr = out.dtype.element_ty
    gate = tl.load(gate_up + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * stride_in + size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype)  # F.silu's result in the model dtype
    tl.store(out + row * stride_out + cols, _cast(silu * up, dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * I] (gate first, up second) -> silu(gate) * up [..., I], a new tensor."""
    size = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * size)
    assert rows.stride(1) == 1 and gate_up.shape[-1] == 2 * size, f"gate_up {tuple(gate_up.shape)}"
    out = torch.empty(rows.shape[0], size, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] > 0 and size > 0:
        block = min(1024, triton.next_power_of_2(size))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, block))](
            rows, out, rows.stride(0), out.stride(0), size, BLOCK=block, num_warps=4
        )
    return out.view(*gate_up.shape[:-1], size)
