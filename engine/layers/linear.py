"""Tensor-parallel linear layers. Each parameter carries its own ``weight_loader`` that reads
only this shard's rows or columns from the checkpoint (see ``engine.weights.TensorSource``).

    ColumnParallel  W [out, in] split on out: each shard computes a slice of the outputs.
    RowParallel     W [out, in] split on in:  each shard a partial sum, then all-reduce.
    QKVParallel     fused [q; k; v] rows of this shard's heads (KV heads replicated when tp > kv heads).
    MergedColumn    fused [gate; up] rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_kernels import SMALL_M_ROWS, CPUKernels, kernels_for
from engine.distributed.parallel import TensorParallel
from engine.weights import TensorSource


def small_m_kernels(tp: TensorParallel, dtype: torch.dtype) -> CPUKernels | None:
    """The CPU kernels where they have a faster product for a few rows of this dtype, else None."""
    kernels = kernels_for(tp.device)
    return kernels if kernels is not None and kernels.has_small_m_linear(dtype) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: CPUKernels | None):
    """F.linear, except a decode step of one or two rows on a CPU whose bfloat16 GEMV is slow."""
    if kernels is not None and x.shape[0] <= SMALL_M_ROWS:
        out = kernels.small_m_linear(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


def _param(shape: Sequence[int], dtype: torch.dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        assert out_features % tp.size == 0, f"{out_features} outputs do not split over {tp.size} shards"
        self.tp = tp
        self.out_per_shard = out_features // tp.size
        self.weight = _param((self.out_per_shard, in_features), dtype, self.load_rows)
        self.bias = _param((self.out_per_shard,), dtype, self.load_rows) if bias else None
        self.kernels = small_m_kernels(tp, dtype)

    def load_rows(self, param: nn.Parameter, source: TensorSource, shard_id: object = None) -> None:
        size = param.shape[0]
        param.data.copy_(source.narrow(0, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices of the given output sizes stacked into one matmul."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool, tp: TensorParallel, dtype):
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias, tp, dtype)

    def load_rows(self, param: nn.Parameter, source: TensorSource, shard_id: object = None) -> None:
        assert isinstance(shard_id, int), "merged layers load one sub-matrix at a time"
        size = self.out_sizes[shard_id] // self.tp.size
        offset = sum(self.out_sizes[:shard_id]) // self.tp.size
        param.data.narrow(0, offset, size).copy_(source.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Rows of this shard: [its query heads | its KV head(s) of k | the same of v].

    With tp > num_kv_heads, KV heads are replicated: shard r holds KV head r * num_kv_heads // tp,
    which is the head its query heads attend to (as vLLM does).
    """

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
    ):
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_head_start = tp.rank * num_kv_heads // tp.size
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden, out, bias, tp, dtype)

    def load_rows(self, param: nn.Parameter, source: TensorSource, shard_id: object = None) -> None:
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            dst, src = param.data.narrow(0, 0, q_rows), source.narrow(0, self.tp.rank * q_rows, q_rows)
        elif shard_id in ("k", "v"):
            offset = q_rows if shard_id == "k" else q_rows + kv_rows
            dst = param.data.narrow(0, offset, kv_rows)
            src = source.narrow(0, self.kv_head_start * self.head_dim, kv_rows)
        else:
            raise AssertionError(f"unknown qkv shard {shard_id!r}")
        dst.copy_(src)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        assert in_features % tp.size == 0, f"{in_features} inputs do not split over {tp.size} shards"
        self.tp = tp
        self.in_per_shard = in_features // tp.size
        self.weight = _param((out_features, self.in_per_shard), dtype, self.load_cols)
        self.bias = _param((out_features,), dtype, self.load_full) if bias else None
        self.kernels = small_m_kernels(tp, dtype)

    def load_cols(self, param: nn.Parameter, source: TensorSource, shard_id: object = None) -> None:
        size = param.shape[1]
        param.data.copy_(source.narrow(1, self.tp.rank * size, size))

    def load_full(self, param: nn.Parameter, source: TensorSource, shard_id: object = None) -> None:
        param.data.copy_(source.full())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias joins once, after the partial sums meet.
        y = self.tp.all_reduce(linear(x, self.weight, None, self.kernels))
        return y + self.bias if self.bias is not None else y
