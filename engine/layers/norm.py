from __future__ import annotations

import torch
from torch import nn

from engine.cpu_kernels import CPUKernels


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 like Hugging Face's so outputs match bit for bit in fp32.

    ``forward(x, residual_delta)`` first adds the previous sublayer's output into the residual
    stream ``x`` in place (what the decoder layer's ``hidden + sublayer(...)`` does), in the same
    pass over memory when the CPU kernels are there."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, kernels: CPUKernels | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps, residual_delta)
        if residual_delta is not None:
            x.add_(residual_delta)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
