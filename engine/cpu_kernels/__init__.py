"""CPU kernels in plain C, built once per machine and called through ctypes.

    paged_attention.c  attention that reads keys/values in place from the block-paged KV cache
                       (decodes: one query row a sequence)
    prefill_attention.c  the same contract tiled for prefill chunks (16 query rows an item), every
                       chunk of a step in one call (bfloat16 on AVX512_BF16: the native pair dot)
    fused.c            RMSNorm (+ the residual add), SiLU-and-multiply, rotary embedding in place

Why C and not torch ops: at batch 1 a Llama layer was ~40 small torch ops whose dispatch cost
more than their arithmetic, and a decode step spent 40% of its time gathering each sequence's
blocks out of the paged cache before attending to them. The sources need no torch headers, so a
build takes about a second with the system's C compiler (gcc is on our machines); the shared
object is cached under ``common.env.cache_dir()/kernels``, keyed by the sources, the compiler
and this CPU's feature flags (it is built with ``-march=native``, and machines differ from day
to day). OpenMP inside resolves to the runtime torch already loaded, so the kernels share
torch's threads. ctypes releases the GIL for each call.

``cpu_kernels()`` returns None where no compiler is found, the build fails, or
``PDSERVE_CPU_KERNELS=0``; callers then run the plain torch ops (which CUDA always runs).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from common import env

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = ("paged_attention.c", "prefill_attention.c", "fused.c")
_HEADERS = ("common.h",)
# No -ffast-math: in a shared object it can switch the whole process to flush denormals to zero.
_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11")
_BUILD_TIMEOUT_S = 120.0


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _isa_cap_flags() -> tuple[str, ...]:
    """Flags that keep ``-march=native`` within torch's own vector ISA: where torch runs AVX2 on an
    AVX-512 CPU (``ATEN_CPU_CAPABILITY=avx2``, as our AVX2-only machines do natively), the kernels
    leave AVX-512 out too, so one variable set before start makes the whole engine behave as on an
    AVX2-only machine (the suite and the benchmarks emulate one that way)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    capability = torch.backends.cpu.get_cpu_capability()
    return () if capability.startswith("AVX512") else ("-mno-avx512f",)


def build(compiler: str, march: str = "native") -> Path:
    """The cached shared object for these sources on this machine, built if missing. ``march``
    other than native builds the portable code paths (the tests check them against the native)."""
    flags = (*_FLAGS, f"-march={march}", *(_isa_cap_flags() if march == "native" else ()))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        key.update((_HERE / name).read_bytes())
    for part in (version, " ".join(flags), _cpu_flags()):
        key.update(part.encode())
    target = env.cache_dir() / "kernels" / f"pdserve_cpu-{march}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: concurrent builders never load half a file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        sources = [str(_HERE / name) for name in _SOURCES]
        command = [compiler, *flags, "-o", tmp, *sources, "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
# Both attention kernels take one contract (paged_attention.c, prefill_attention.c).
_ATTENTION = (ctypes.c_int, [_P, _I64, _P, _P, _P, _I64, _P, _I64, _P, _P, _P, _I32, _I32, _I32, _I32, _I32, _F32])
_SIGNATURES = {
    "paged_attention": _ATTENTION,
    "prefill_attention": _ATTENTION,
    "rms_norm": (None, [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I32, _F32]),
    "silu_and_mul": (None, [_P, _I64, _P, _I64, _I64, _I32]),
    "rotary": (None, [_P, _I64, _I32, _P, _I64, _I32, _P, _P, _P, _I64, _I32]),
    "write_kv": (None, [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64]),
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _row_major(t: torch.Tensor, name: str) -> None:
    """Rows may be strided (views into a fused projection's output); each row must be packed."""
    assert t.dim() == 2 and t.stride(1) == 1, f"{name} must be [rows, n] with packed rows"


class CPUKernels:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for op, (restype, argtypes) in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(library, f"{op}_{suffix}")
                fn.restype, fn.argtypes = restype, argtypes
                self._fns[(op, dtype)] = fn
        library.bf16_rounding_is_native.restype, library.bf16_rounding_is_native.argtypes = ctypes.c_int, []
        # bf16 results round through vcvtneps2bf16, which flushes denormal results to zero (fused.c)
        self.bf16_rounding_is_native = bool(library.bf16_rounding_is_native())

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in _SUFFIX

    def _fn(self, op: str, dtype: torch.dtype):
        try:
            return self._fns[(op, dtype)]
        except KeyError:
            raise TypeError(f"the CPU kernel {op} takes float32 or bfloat16, not {dtype}") from None

    def raw(self, op: str, dtype: torch.dtype):
        """The C function itself (ctypes, pointer and integer arguments as ``_SIGNATURES`` lists
        them), for a caller that checks shapes, strides and dtypes once for many calls (the CPU
        layer loop, ``engine.models.llama_cpu``); the methods below check every call."""
        return self._fn(op, dtype)

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """k/v [tokens, kv_heads, head_dim] (packed heads, rows may be strided) into their slots of
        the caches [blocks, block_size, kv_heads, head_dim]; slots int64, each < blocks x block_size."""
        tokens, kv_heads, head_dim = k.shape
        assert v.shape == k.shape and k.dtype == v.dtype == key_cache.dtype == value_cache.dtype
        for t in (k, v):
            assert t.stride(2) == 1 and t.stride(1) == head_dim, "k/v rows must pack heads and head_dim"
        assert key_cache.is_contiguous() and value_cache.is_contiguous() and key_cache.shape == value_cache.shape
        assert key_cache.shape[2:] == (kv_heads, head_dim) and slots.dtype == torch.int64 and slots.is_contiguous()
        assert slots.shape == (tokens,)
        self._fn("write_kv", k.dtype)(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            slots.data_ptr(),
            tokens,
            kv_heads * head_dim,
        )

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        block_tables: torch.Tensor,
        query_start: torch.Tensor,
        query_len: torch.Tensor,
        context_len: torch.Tensor,
        scale: float,
        *,
        op: str = "paged_attention",
    ) -> None:
        """query/out [tokens, heads, head_dim] with heads and head_dim packed (rows may be strided);
        caches [blocks, block_size, kv_heads, head_dim] contiguous; int64 block_tables [seqs,
        max_blocks] and per-sequence vectors. Sequence s's query rows query_start[s] ..
        + query_len[s] sit at the last query_len[s] of its context_len[s] positions (causal).
        ``op="prefill_attention"``: the same through the tiled kernel for prefill chunks."""
        sequences = SequencePointers.of(block_tables, query_start, query_len, context_len)
        self._attend(query, key_cache, value_cache, out, sequences, scale, op)

    def prefill_attention(self, *args, **kwargs) -> None:
        """``paged_attention`` through the tiled prefill kernel (prefill_attention.c)."""
        self.paged_attention(*args, **kwargs, op="prefill_attention")

    def _attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        sequences: SequencePointers,
        scale: float,
        op: str,
    ) -> None:
        _, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        # The C code trusts these: a mistake would read out of bounds rather than raise.
        assert key_cache.dtype == value_cache.dtype == query.dtype == out.dtype, "caches, query and out differ in dtype"
        assert key_cache.shape == value_cache.shape and key_cache.shape[3] == head_dim
        assert key_cache.is_contiguous() and value_cache.is_contiguous()
        assert num_heads % num_kv_heads == 0 and block_size & (block_size - 1) == 0
        for t in (query, out):
            assert t.stride(2) == 1 and t.stride(1) == head_dim, "query/out rows must pack heads and head_dim"
        status = self._fn(op, query.dtype)(
            query.data_ptr(),
            query.stride(0),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            sequences.block_tables,
            sequences.block_table_stride,
            sequences.query_start,
            sequences.query_len,
            sequences.context_len,
            sequences.num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
        )
        if status != 0:
            raise MemoryError(f"the CPU kernel {op} could not allocate its buffers")

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual_delta: torch.Tensor | None = None
    ) -> torch.Tensor:
        """weight * RMSNorm(x) as a new tensor; with ``residual_delta``, x += residual_delta first,
        in place (x then holds the residual stream the next layer adds to)."""
        _row_major(x, "x")
        rows, hidden = x.shape
        assert weight.is_contiguous() and weight.shape == (hidden,) and weight.dtype == x.dtype
        out = torch.empty((rows, hidden), dtype=x.dtype)
        if residual_delta is not None:
            _row_major(residual_delta, "residual_delta")
            assert residual_delta.shape == x.shape and residual_delta.dtype == x.dtype
        self._fn("rms_norm", x.dtype)(
            x.data_ptr(),
            x.stride(0),
            residual_delta.data_ptr() if residual_delta is not None else None,
            residual_delta.stride(0) if residual_delta is not None else 0,
            weight.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            rows,
            hidden,
            eps,
        )
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows [gate | up]."""
        _row_major(gate_up, "gate_up")
        rows, width = gate_up.shape
        assert width % 2 == 0, "gate_up rows are [gate | up]"
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._fn("silu_and_mul", gate_up.dtype)(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), rows, width // 2
        )
        return out

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """In place on q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] (views with
        packed heads; rows may be strided); cos/sin the full [max_positions, head_dim] tables.
        Positions must lie inside the tables (the CPU layer loop checks once a step)."""
        tokens, num_q_heads, head_dim = q.shape
        for t in (q, k):
            assert t.stride(2) == 1 and t.stride(1) == head_dim, "rotary needs packed heads"
        assert cos.is_contiguous() and sin.is_contiguous() and positions.is_contiguous()
        assert positions.dtype == torch.int64 and cos.dtype == q.dtype == k.dtype
        self._fn("rotary", q.dtype)(
            q.data_ptr(),
            q.stride(0),
            num_q_heads,
            k.data_ptr(),
            k.stride(0),
            k.shape[1],
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            tokens,
            head_dim,
        )


@functools.cache
def cpu_kernels() -> CPUKernels | None:
    """The compiled kernels, or None (disabled, no compiler, or the build failed: logged once)."""
    if not env.cpu_kernels_enabled():
        logger.info("CPU kernels disabled (PDSERVE_CPU_KERNELS=0): the engine runs plain torch ops")
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: the engine runs plain torch ops on CPU (slower)")
        return None
    try:
        path = build(compiler)
        kernels = CPUKernels(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the CPU kernels failed; the engine runs plain torch ops: %s", detail)
        return None
    logger.info("CPU kernels: %s", path)
    return kernels


@dataclass(frozen=True)
class SequencePointers:
    """The per-sequence arguments of the attention kernel, as the C code takes them. The tensors
    behind the pointers must outlive every call (``DecodeAttention`` holds them)."""

    block_tables: int
    block_table_stride: int
    query_start: int
    query_len: int
    context_len: int
    num_seqs: int

    @classmethod
    def of(cls, block_tables, query_start, query_len, context_len) -> SequencePointers:
        """Checked once here: the C code trusts these and would read out of bounds instead."""
        for t in (block_tables, query_start, query_len, context_len):
            assert t.is_contiguous() and t.dtype == torch.int64
        assert block_tables.shape[0] == len(query_start) == len(query_len) == len(context_len)
        assert bool((query_len <= context_len).all()), "a sequence's query rows are part of its context"
        return cls(
            block_tables.data_ptr(),
            block_tables.stride(0),
            query_start.data_ptr(),
            query_len.data_ptr(),
            context_len.data_ptr(),
            len(context_len),
        )


class DecodeAttention:
    """The attention kernel's arguments for a step's decodes (one query row per sequence), bound
    to the step's block tables and context lengths and checked once: every layer of the step
    passes ``sequences`` to the kernel (``engine.models.llama_cpu``)."""

    def __init__(self, block_tables: torch.Tensor, context_len: torch.Tensor) -> None:
        num_seqs = len(context_len)
        starts, ones = torch.arange(num_seqs), torch.ones(num_seqs, dtype=torch.int64)
        self._tensors = (block_tables, context_len, starts, ones)  # kept alive for the pointers
        self.sequences = SequencePointers.of(block_tables, starts, ones, context_len)


class PrefillAttention:
    """The tiled prefill kernel's arguments for a step's prefill chunks (``prefill_attention.c``),
    bound to their rows, block tables and context lengths once a step: each layer of the step
    passes ``sequences`` to the kernel, which attends to every chunk in one call."""

    def __init__(
        self, block_tables: torch.Tensor, query_start: torch.Tensor, query_len: torch.Tensor, context_len: torch.Tensor
    ) -> None:
        self._tensors = (block_tables, query_start, query_len, context_len)  # kept alive for the pointers
        self.sequences = SequencePointers.of(block_tables, query_start, query_len, context_len)


def load(path: Path) -> CPUKernels:
    return CPUKernels(ctypes.CDLL(str(path)))


def kernels_for(device: torch.device) -> CPUKernels | None:
    return cpu_kernels() if device.type == "cpu" else None
