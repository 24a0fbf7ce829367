"""The fused Triton layer ops against the torch layers they replace (engine.layers, LlamaMLP).

Without a GPU they run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 set before the
module is imported); with one they run compiled on it.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.layers.norm import RMSNorm  # noqa: E402
from engine.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from engine.layers.triton_ops import fused_add_rms_norm, rotary_inplace, silu_and_mul  # noqa: E402

# float32 within an ulp or two of the reference; half types within one ulp of theirs.
TOLERANCE = {
    torch.float32: {"atol": 1e-6, "rtol": 1e-6},
    torch.bfloat16: {"atol": 1e-6, "rtol": 2**-7},
    torch.float16: {"atol": 1e-6, "rtol": 2**-10},
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _assert_rounded_like(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Within an ulp, and in a half type almost always the very value: an intermediate not rounded
    to the dtype where the reference rounds it moves about a quarter of the outputs by an ulp,
    while exp/rsqrt/summation order may move a rare one (none in the interpreter)."""
    torch.testing.assert_close(out, expected, **TOLERANCE[out.dtype])
    if out.dtype != torch.float32:
        assert (out != expected).float().mean() <= 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
def test_fused_add_rms_norm_matches_rmsnorm(dtype, with_delta):
    gen = torch.Generator().manual_seed(1)
    hidden = 576  # SmolLM2's: not a power of two
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    x = (3 * torch.randn(2, 3, hidden, generator=gen)).to(dtype)
    delta = torch.randn(2, 3, hidden, generator=gen).to(dtype) if with_delta else None
    expected_x = x.clone()
    expected = norm(expected_x, delta)

    x_dev = x.clone().to(DEVICE)
    out = fused_add_rms_norm(x_dev, None if delta is None else delta.to(DEVICE), norm.weight.to(DEVICE), 1e-5)

    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(x_dev.cpu(), expected_x), "the residual stream is updated in place, rounded as x.add_"
    _assert_rounded_like(out.cpu(), expected)
    if with_delta:  # can fail: normalising without the add gives another answer
        assert not torch.allclose(out.cpu(), norm(x.clone()), atol=1e-2)


def _rotary_case(dtype, gen):
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    rope = RotaryEmbedding(head_dim, 64, {"rope_theta": 10000.0, "rope_type": "default"}, dtype)
    qkv = torch.randn(5, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 7, 63, 31, 8])
    return rope, qkv, positions, [num_heads, num_kv_heads, num_kv_heads]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_inplace_matches_apply_rotary(dtype):
    gen = torch.Generator().manual_seed(2)
    rope, qkv, positions, split = _rotary_case(dtype, gen)
    q, k, v = qkv.split(split, dim=1)
    expected_q, expected_k = apply_rotary(q, k, rope.for_positions(positions))

    qkv_dev = qkv.clone().to(DEVICE)
    q_dev, k_dev, _ = qkv_dev.split(split, dim=1)  # strided views of the fused tensor
    rotary_inplace(q_dev, k_dev, positions.to(DEVICE), rope.cos.to(DEVICE), rope.sin.to(DEVICE))

    q_out, k_out, v_out = qkv_dev.cpu().split(split, dim=1)
    # Half types bit for bit: the kernel rounds each product and the sum as the reference does.
    tolerance = TOLERANCE[dtype] if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(q_out, expected_q, **tolerance)
    torch.testing.assert_close(k_out, expected_k, **tolerance)
    assert torch.equal(v_out, v), "v lies between nothing the kernel may touch"
    # Can fail: one position off gives another rotation.
    shifted_q, _ = apply_rotary(q, k, rope.for_positions((positions + 1) % 64))
    assert not torch.allclose(q_out, shifted_q, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_mlp(dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = (2 * torch.randn(2, 3, 2 * 96, generator=gen)).to(dtype)  # 96: not a power of two
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up

    out = silu_and_mul(gate_up.to(DEVICE)).cpu()

    assert out.shape == (2, 3, 96) and out.dtype == dtype
    _assert_rounded_like(out, expected)
    assert not torch.allclose(out, F.silu(up) * gate, atol=1e-2), "can fail: halves swapped"
