from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 like Hugging Face's so outputs match bit for bit in fp32.

    ``forward(x, residual_delta)`` first adds the previous sublayer's output into the residual
    stream ``x`` in place (what the decoder layer's ``hidden + sublayer(...)`` does). On CPU the
    layer loop (``engine.models.llama_cpu``) runs the same arithmetic in one kernel pass."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.fused = None  # the Triton kernel (engine.layers.triton_ops) where the model runs them

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None = None) -> torch.Tensor:
        if self.fused is not None:  # the add and the norm in one kernel instead of nine
            return self.fused(x, residual_delta, self.weight, self.eps)
        if residual_delta is not None:
            x.add_(residual_delta)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
