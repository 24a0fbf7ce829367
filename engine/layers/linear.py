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

from engine.distributed.parallel import TensorParallel
from engine.weights import TensorSource

# oneDNN sizes its packed layout for this many rows; measured at 1 to 2,048 rows, it made little
# difference (a layout packed for 64 rows ran 2,048-row products as fast).
_PACKING_ROWS_HINT = 2048


def cpu_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this engine's linear weights are kept pre-packed in oneDNN's layout, on a CPU build
    of torch with oneDNN: float32 on AVX2 and AVX-512 CPUs (where it was measured), bfloat16 where
    oneDNN runs it (AVX-512 BW/VL/DQ or newer; elsewhere it refuses to pack). F.linear hands a
    plain weight to oneDNN (bfloat16) or MKL (float32), and oneDNN reorders it into its blocked
    layout again on every call. Packed once at load, SmolLM2's products on a 2-core EPYC
    (AVX512-BF16, no AMX): bfloat16 12 ms instead of 21 at one row, 17 instead of 27 at 64, 187
    instead of 225-352 at 2,048; float32 (against MKL on column-major weights, cold caches, whole
    engine steps) a prefill step of 8 x 256 tokens 2.7-2.9 s instead of 3.4-4.4, decode at 16
    sequences 62-64 ms instead of 117-204, at one sequence 34-37 ms instead of 43-48."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        # Measured on x86 only; elsewhere (Arm) MKL's or OpenBLAS's product on column-major weights
        # stays. On AVX2 (emulated on an AVX-512 EPYC: ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2,
        # MKL_ENABLE_INSTRUCTIONS=AVX2), the offline job of 64 x 256/64 tokens took 43.6-48.8 s
        # packed against 51.2-53.2 s through MKL (docs/benchmarks.md, "bfloat16 on CPUs without it").
        capability = torch.backends.cpu.get_cpu_capability()
        return capability.startswith("AVX512") or capability == "AVX2"
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's packed layout (an opaque mkldnn tensor), for ``linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACKING_ROWS_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    """F.linear, or the same product through the weight's packed copy where it has one (then the
    packed copy is the weight: see ``pack_linear_weights``)."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` that multiplies through ``linear`` (the layers here and the LM
    head): the ones that carry a ``packed`` slot."""
    return [m for m in model.modules() if hasattr(m, "packed") and isinstance(m.weight, torch.Tensor)]


def pack_linear_weights(model: nn.Module) -> int:
    """Give every linear layer of ``model`` (and the LM head) a packed copy of its weight, after
    loading; returns how many. The plain weight's memory is then released, except where another
    module shares it (a tied embedding, which looks rows up in it): ``weight`` keeps its shape and
    dtype for whoever reads them, but no values, so anything that changes a weight after this
    must load and pack it again."""
    modules = linear_modules(model)
    module_ids = {id(m) for m in modules}
    shared = {id(p) for m in model.modules() if id(m) not in module_ids for p in m.parameters(recurse=False)}
    for module in modules:
        module.packed = pack_weight(module.weight)
        if id(module.weight) not in shared:
            weight = module.weight
            # Shape and dtype stay (benchmarks and FLOP counts read them); one element of storage.
            weight.data = torch.empty_strided(weight.shape, (0, 0), dtype=weight.dtype, device=weight.device)
    return len(modules)


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
        self.packed: torch.Tensor | None = None  # pack_linear_weights sets it, after loading

    def load_rows(self, param: nn.Parameter, source: TensorSource, shard_id: object = None) -> None:
        size = param.shape[0]
        param.data.copy_(source.narrow(0, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


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
        self.packed: torch.Tensor | None = None  # pack_linear_weights sets it, after loading

    def load_cols(self, param: nn.Parameter, source: TensorSource, shard_id: object = None) -> None:
        size = param.shape[1]
        param.data.copy_(source.narrow(1, self.tp.rank * size, size))

    def load_full(self, param: nn.Parameter, source: TensorSource, shard_id: object = None) -> None:
        param.data.copy_(source.full())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias joins once, after the partial sums meet.
        y = self.tp.all_reduce(linear(x, self.weight, None, self.packed))
        return y + self.bias if self.bias is not None else y
