"""Whether the Triton kernels compile and agree with torch on this device, checked once at start-up.

``attention_backend: auto`` picks Triton on CUDA. A GPU, driver or Triton version the kernels were
never compiled on could fail to build them or, worse, build them wrong; a replica must then serve
on the torch backend with a warning, not die or answer garbage. The check runs one small paged
decode, one prefill chunk after earlier context and one fused add-and-norm in the model's own
head shapes and dtype, against plain torch.
"""

from __future__ import annotations

import torch

# float32 through the kernels' float32 math; half types round once more than the reference.
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def triton_unusable(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> str | None:
    """None if the kernels work here; else why not (an exception's message or the error found)."""
    try:
        from engine.attention import triton_kernels
        from engine.layers import triton_ops

        return _check(triton_kernels, triton_ops, device, dtype, num_heads, num_kv_heads, head_dim, block_size)
    except Exception as exc:  # a compiler or driver error: whatever it is, the torch backend serves
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def _check(kernels, ops, device, dtype, num_heads, num_kv_heads, head_dim, block_size) -> str | None:
    gen = torch.Generator().manual_seed(0)
    context, chunk = block_size + 5, 7  # a partial block, and a chunk that continues after context
    num_blocks = 2 * (-(-context // block_size)) + 1
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    table = torch.randperm(num_blocks - 1, generator=gen)[: -(-context // block_size)] + 1
    keys = torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype)
    queries = torch.randn(context, num_heads, head_dim, generator=gen).to(dtype)
    positions = torch.arange(context)
    slots = table[positions // block_size] * block_size + positions % block_size
    scale = head_dim**-0.5
    reference = _attention(queries, keys, values, scale)

    cache, slots_d = cache.to(device), slots.to(device)
    kernels.store_kv(keys.to(device), values.to(device), cache[0], cache[1], slots_d)
    tables = table.to(device=device, dtype=torch.int32)[None, :]
    decode = torch.empty(1, num_heads, head_dim, dtype=dtype, device=device)
    lens = torch.tensor([context], dtype=torch.int32, device=device)
    kernels.paged_decode_attention(queries[-1:].to(device), cache[0], cache[1], tables, lens, scale, decode, 2)
    prefill = torch.empty(chunk, num_heads, head_dim, dtype=dtype, device=device)
    starts = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    kernels.paged_prefill_attention(
        queries[-chunk:].to(device), cache[0], cache[1], tables, starts, lens, chunk, scale, prefill
    )
    tolerance = _TOLERANCE[dtype]
    for name, got, want in (("decode", decode, reference[-1:]), ("prefill", prefill, reference[-chunk:])):
        error = (got.float().cpu() - want).abs().max().item()
        if not error <= tolerance * max(1.0, want.abs().max().item()):  # NaN fails too
            return f"paged {name} attention differs from torch by {error:.3g}"

    hidden = torch.randn(3, 8 * head_dim, generator=gen).to(dtype)
    delta = torch.randn(3, 8 * head_dim, generator=gen).to(dtype)
    weight = torch.randn(8 * head_dim, generator=gen).to(dtype)
    residual = (hidden + delta).float()
    want_norm = weight.float() * (residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got_norm = ops.fused_add_rms_norm(hidden.to(device), delta.to(device), weight.to(device), 1e-5)
    error = (got_norm.float().cpu() - want_norm.float()).abs().max().item()
    if not error <= tolerance * max(1.0, want_norm.abs().max().item()):
        return f"fused add-and-RMSNorm differs from torch by {error:.3g}"
    return None


def _attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of every position, float32, query heads grouped over the KV heads."""
    group = queries.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", queries.float(), k) * scale
    n = queries.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
