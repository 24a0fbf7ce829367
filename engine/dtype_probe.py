"""What ``dtype="auto"`` means on this machine: bfloat16 on CUDA; on CPU, whichever dtype
multiplies the model's kind of matrices faster here, measured once per process.

CPUs differ by an order of magnitude: with AMX, bf16 ``F.linear`` at 256 rows ran at 470
GFLOP/s against float32's 200; without AMX or AVX512-BF16, bf16 is emulated and ran at 30
against float32's 240 (both measured on 2-core Xeons). A margin keeps a noisy probe from
flipping between the two where they are close; every shard and every replica of one cluster
must agree, so the driver resolves "auto" once and hands the explicit name to the others.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from common import env
from engine.layers.linear import cpu_packing_available, linear, pack_weight

logger = logging.getLogger(__name__)

BFLOAT16_MARGIN = 1.3  # bf16 must beat float32 by this factor to be chosen
_PROBE_SHAPE = (256, 576, 1536)  # rows, in, out: a prefill chunk through a small model's MLP


@dataclass(frozen=True)
class DtypeProbe:
    float32_gflops: float
    bfloat16_gflops: float

    @property
    def choice(self) -> str:
        return "bfloat16" if self.bfloat16_gflops >= BFLOAT16_MARGIN * self.float32_gflops else "float32"


def _gflops(dtype: torch.dtype, budget_s: float) -> float:
    rows, inner, outer = _PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inner, generator=generator).to(dtype)
    w = torch.randn(outer, inner, generator=generator).to(dtype)
    # The product as the engine will run it: through weights packed at load where it packs them.
    packed = pack_weight(w) if cpu_packing_available(torch.device("cpu"), dtype) else None
    with torch.inference_mode():
        linear(x, w, None, packed)  # first call pays the library's set-up
        best, spent = float("inf"), 0.0
        while spent < budget_s:
            start = time.perf_counter()
            linear(x, w, None, packed)
            elapsed = time.perf_counter() - start
            best, spent = min(best, elapsed), spent + elapsed
    return 2 * rows * inner * outer / best / 1e9


@functools.cache
def probe_cpu_matmul(budget_s: float = 0.05) -> DtypeProbe:
    return DtypeProbe(_gflops(torch.float32, budget_s), _gflops(torch.bfloat16, budget_s))


def resolve_auto_dtype(device: torch.device) -> str:
    """The dtype name "auto" stands for on ``device``; logged once per process on CPU."""
    if device.type == "cuda":
        return "bfloat16"
    pinned = env.cpu_auto_dtype()
    if pinned is not None:
        return pinned
    probe = probe_cpu_matmul()
    _log_choice(probe)
    return probe.choice


def advise_on_bfloat16(device: torch.device) -> DtypeProbe | None:
    """An explicit bfloat16 on a CPU that multiplies float32 faster (no AVX512_BF16 or AMX: torch
    then runs bf16 products in its own emulated loops): it runs, correctly, and says once that
    float32 would be faster here. Returns the probe that said so, else None."""
    if device.type != "cpu":
        return None
    probe = probe_cpu_matmul()
    if probe.bfloat16_gflops >= probe.float32_gflops:
        return None
    _warn_slow_bfloat16(probe)
    return probe


@functools.cache
def _warn_slow_bfloat16(probe: DtypeProbe) -> None:
    logger.warning(
        "dtype=bfloat16 on this CPU is emulated, not native (products %dx%dx%d: bfloat16 %.0f GFLOP/s, float32 "
        "%.0f GFLOP/s): output is correct, but --dtype float32 (or auto) would run %.1fx faster here",
        *_PROBE_SHAPE,
        probe.bfloat16_gflops,
        probe.float32_gflops,
        probe.float32_gflops / probe.bfloat16_gflops,
    )


@functools.cache
def _log_choice(probe: DtypeProbe) -> None:
    logger.info(
        "dtype=auto on this CPU: %s (products %dx%dx%d: float32 %.0f GFLOP/s, bfloat16 %.0f GFLOP/s; "
        "bfloat16 needs %.1fx)",
        probe.choice,
        *_PROBE_SHAPE,
        probe.float32_gflops,
        probe.bfloat16_gflops,
        BFLOAT16_MARGIN,
    )
