"""One model instance against this machine's own ceilings, measured in the same run.

    python -m bench.roofline [--dtypes float32 bfloat16] [--steps 10]

Ceilings, per dtype: GFLOP/s of the engine's own product (F.linear, or oneDNN on the weights
packed at load, as the engine runs them) through the model's own weight matrices (one layer's
qkv, o, gate_up and down, as the engine stores them) at M = 1, 32, 64, 256 and 2,048 rows, and
copy bandwidth (bytes read + written per second of a 1 GiB copy). Then three engine steps,
each set against the ceiling it can at best reach:

  prefill   one step of 8 x 256-token prompts (2,048 tokens)   model FLOPs / step time vs GEMM at M=2048
  decode64  a decode step of 64 sequences at ~320-token context model FLOPs / step time vs GEMM at M=64
  decode1   a decode step of one sequence at ~320 tokens       step time / the time of one batch-1 product
                                                               through every weight matrix (the "GEMVs")

Decode steps are also set against two floors: their matmuls at the GEMM ceiling, and their bytes
(every weight matrix once, the keys and values of every position attended) read once at the
machine's read bandwidth (a 1 GiB sum); "of bound" is the larger floor over the step time. A
decode step at long contexts is a stream through memory: no share of the GEMM ceiling it cannot
be fed.

Each step is timed back to back with its ceiling (the ratio of each pair, then the median): the
machine is shared, and a ceiling measured a minute apart from the step it judges can be off by 1.5x.
Model FLOPs count the matmuls (2 x rows x params of each matrix; the LM head only for the rows
that sample) and attention (QK^T and PV: 4 x heads x head_dim per query-key pair attended).
The issue's targets: prefill >= 0.60, decode64 >= 0.50, decode1 step <= 1.25 x the GEMVs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import exact_length_prompts, print_table, write_json
from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from common.sampling_params import SamplingParams
from engine.layers.linear import linear, linear_modules
from engine.llm_engine import LLMEngine

GEMM_ROWS = (1, 32, 64, 256, 2048)
PREFILL_PROMPTS, PREFILL_LEN = 8, 256
DECODE_BATCH, DECODE_CONTEXT = 64, 320
PREFILL_STEPS_MAX = 48  # steps that may bring the decode batch's prompts in


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best of ``repeats`` copies of a ``num_bytes`` buffer, counting bytes read plus bytes written."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read per second summing a ``num_bytes`` buffer (best of ``repeats``): what a step that
    streams its weights and KV cache from memory can at best be fed."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / _best_time(src.sum, budget_s=0.0, min_runs=repeats)


def _layer_modules(engine: LLMEngine) -> list:
    layer = engine.executor.driver.model.model.layers[0]
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _layer_matrices(engine: LLMEngine) -> list[torch.Tensor]:
    return [m.weight for m in _layer_modules(engine)]


def _best_time(fn, budget_s: float = 0.3, min_runs: int = 3) -> float:
    fn()
    best, spent, runs = float("inf"), 0.0, 0
    while spent < budget_s or runs < min_runs:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return best


def _products(modules) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, packed copy or None) of each module: what the engine's ``linear`` multiplies by."""
    return [(m.weight, m.packed) for m in modules]


class Ceilings:
    """The machine's matmul ceilings through this engine's own weights and its own product
    (``engine.layers.linear.linear``: F.linear, or oneDNN on weights packed at load where the
    engine packs them): the fastest products we have for these matrices."""

    def __init__(self, engine: LLMEngine) -> None:
        self.layer = _products(_layer_modules(engine))
        # Every linear module once, the LM head included (tied to the embedding on SmolLM2).
        self.every = _products(linear_modules(engine.executor.driver.model))
        self._inputs: dict[int, list[torch.Tensor]] = {}
        self._gemv_inputs = [torch.randn(1, w.shape[1], dtype=w.dtype) for w, _ in self.every]

    def gemm_gflops(self, rows: int, budget_s: float = 0.05) -> float:
        """GFLOP/s through one layer's four matrices at ``rows`` rows (best of a short burst)."""
        if rows not in self._inputs:
            self._inputs[rows] = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w, _ in self.layer]
        inputs = self._inputs[rows]
        flops = sum(2 * rows * w.numel() for w, _ in self.layer)
        pairs = list(zip(inputs, self.layer, strict=True))
        with torch.inference_mode():
            seconds = _best_time(lambda: [linear(x, w, None, packed) for x, (w, packed) in pairs], budget_s)
        return flops / seconds / 1e9

    def gemv_seconds(self, budget_s: float = 0.1) -> float:
        """One batch-1 product through every linear weight once (the LM head's too)."""
        pairs = list(zip(self._gemv_inputs, self.every, strict=True))
        with torch.inference_mode():
            return _best_time(lambda: [linear(x, w, None, packed) for x, (w, packed) in pairs], budget_s)


def model_flops(engine: LLMEngine, tokens: int, sampled: int, attended_pairs: int) -> float:
    shape = engine.executor.driver.shape
    per_layer = sum(w.numel() for w in _layer_matrices(engine))
    linear = 2 * tokens * per_layer * shape.num_layers + 2 * sampled * shape.vocab_size * shape.hidden_size
    attention = 4 * shape.num_heads * shape.head_dim * attended_pairs * shape.num_layers
    return float(linear + attention)


def _step_bytes(engine: LLMEngine, attended_pairs: int) -> float:
    """Bytes a decode step must read at least: every linear weight once (the LM head's included;
    of an untied embedding only the few rows looked up, not counted), and the keys and values of
    every (sequence, position) pair it attends to."""
    shape = engine.executor.driver.shape
    weights = {id(m.weight): m.weight for m in linear_modules(engine.executor.driver.model)}
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    element = next(iter(weights.values())).element_size()
    kv_per_position = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * element
    return float(weight_bytes + kv_per_position * attended_pairs)


def time_prefill(engine: LLMEngine, prompts: list[list[int]], repeats: int, ceiling) -> list[tuple[float, float]]:
    """(seconds, ceiling) pairs: one step that prefills every prompt (the budget holds them all),
    each followed at once by a measurement of ``ceiling()``, so each pair saw the same machine."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    pairs = []
    for r in range(repeats + 1):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{r}-{i}", prompt, params)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if r:  # the first step warms the path
            pairs.append((elapsed, ceiling()))
        while engine.has_unfinished_requests():
            engine.step()
    return pairs


def time_decode(
    engine: LLMEngine, prompts: list[list[int]], num_steps: int, ceiling
) -> tuple[list[tuple[float, float]], int]:
    """(seconds, ceiling) pairs of pure decode steps with len(prompts) sequences, each followed by a
    measurement of ``ceiling()``; and the mean context."""
    # Room for the tokens the prefill steps sample too (a prompt prefilled in the first of ~10
    # steps decodes through the rest): every sequence must still run in the last timed step.
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + PREFILL_STEPS_MAX, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)
    prefill_steps = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.iter_live()):
        engine.step()
        prefill_steps += 1
    assert prefill_steps < PREFILL_STEPS_MAX, "raise PREFILL_STEPS_MAX: sequences would finish while timed"
    engine.step()
    pairs, contexts = [], []
    for _ in range(num_steps):
        running = engine.scheduler.running
        assert len(running) == len(prompts), f"{len(running)} of {len(prompts)} sequences running"
        contexts.append(statistics.mean(r.num_tokens for r in running))
        start = time.perf_counter()
        engine.step()
        pairs.append((time.perf_counter() - start, ceiling()))
    for i in range(len(prompts)):
        engine.abort_request(f"d{i}")
    engine.step()
    return pairs, int(statistics.mean(contexts))


def measure(dtype: str, steps: int, read_bytes_per_s: float) -> tuple[list[dict], dict]:
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(dtype=dtype),
            cache=CacheConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=DECODE_BATCH, max_num_batched_tokens=PREFILL_PROMPTS * PREFILL_LEN),
        )
    )
    try:
        ceilings = Ceilings(engine)
        rates = {rows: ceilings.gemm_gflops(rows, budget_s=0.3) for rows in GEMM_ROWS}
        prompts = exact_length_prompts(engine.tokenizer, DECODE_BATCH, DECODE_CONTEXT - steps // 2)
        prefill = time_prefill(
            engine,
            exact_length_prompts(engine.tokenizer, PREFILL_PROMPTS, PREFILL_LEN),
            max(3, steps // 3),
            lambda: ceilings.gemm_gflops(PREFILL_PROMPTS * PREFILL_LEN),
        )
        decode64, context64 = time_decode(engine, prompts, steps, lambda: ceilings.gemm_gflops(DECODE_BATCH))
        decode1, context1 = time_decode(engine, prompts[:1], steps, ceilings.gemv_seconds)
    finally:
        engine.shutdown()
    causal_pairs = PREFILL_PROMPTS * PREFILL_LEN * (PREFILL_LEN + 1) // 2
    prefill_flops = model_flops(engine, PREFILL_PROMPTS * PREFILL_LEN, PREFILL_PROMPTS, causal_pairs)
    decode64_flops = model_flops(engine, DECODE_BATCH, DECODE_BATCH, DECODE_BATCH * context64)

    def compute_row(step: str, flops: float, pairs: list[tuple[float, float]], rows: int, target: str) -> dict:
        seconds = statistics.median(s for s, _ in pairs)
        compute_floor = flops / (statistics.median(c for _, c in pairs) * 1e9)
        return {
            "dtype": dtype,
            "step": step,
            "step ms": seconds * 1e3,
            "GFLOP/s": flops / seconds / 1e9,
            "ceiling": f"GEMM M={rows} {statistics.median(c for _, c in pairs):.0f} GFLOP/s",
            # Each step against the ceiling measured right after it; the median of those ratios.
            "of ceiling": statistics.median(flops / s / 1e9 / c for s, c in pairs),
            "target": target,
            "compute floor ms": compute_floor * 1e3,
        }

    def with_memory_floor(row: dict, step_bytes: float) -> dict:
        # A step can be neither faster than its matmuls at the GEMM ceiling nor than reading its
        # bytes once at the read bandwidth; "of bound" is the larger floor over the step time.
        floor = step_bytes / read_bytes_per_s
        bound = max(floor, row.get("compute floor ms", 0.0) / 1e3)
        return {**row, "memory floor ms": floor * 1e3, "of bound": bound / (row["step ms"] / 1e3)}

    decode1_s = statistics.median(s for s, _ in decode1)
    rows = [
        compute_row(f"prefill {PREFILL_PROMPTS}x{PREFILL_LEN}", prefill_flops, prefill, 2048, ">= 0.60"),
        with_memory_floor(
            compute_row(f"decode {DECODE_BATCH} seqs, ctx {context64}", decode64_flops, decode64, 64, ">= 0.50"),
            _step_bytes(engine, DECODE_BATCH * context64),
        ),
        with_memory_floor(
            {
                "dtype": dtype,
                "step": f"decode 1 seq, ctx {context1}",
                "step ms": decode1_s * 1e3,
                "ceiling": f"GEMVs {statistics.median(g for _, g in decode1) * 1e3:.1f} ms",
                "of ceiling": statistics.median(g / s for s, g in decode1),
                "step / GEMVs": statistics.median(s / g for s, g in decode1),
                "target": "step <= 1.25 x GEMVs",
            },
            _step_bytes(engine, context1),
        ),
    ]
    return rows, {"gemm_gflops": rates, "gemv_seconds": ceilings.gemv_seconds()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10, help="decode steps timed per batch size")
    args = parser.parse_args(argv)

    bandwidth, read = copy_bandwidth(), read_bandwidth()
    rows, ceilings = [], {}
    for dtype in args.dtypes:
        dtype_rows, ceilings[dtype] = measure(dtype, args.steps, read)
        rows += dtype_rows
    threads = torch.get_num_threads()
    print(
        f"copy bandwidth (1 GiB, read+write): {bandwidth / 1e9:.1f} GB/s; read bandwidth (1 GiB sum): "
        f"{read / 1e9:.1f} GB/s; {threads} threads"
    )
    gemm_rows = [
        {"dtype": dtype, **{f"M={m}": ceilings[dtype]["gemm_gflops"][m] for m in GEMM_ROWS}} for dtype in args.dtypes
    ]
    print_table(
        "GEMM ceiling: the engine's product, GFLOP/s through one layer's weights",
        gemm_rows,
        ["dtype"] + [f"M={m}" for m in GEMM_ROWS],
    )
    print_table(
        "Engine steps against the machine's ceilings",
        rows,
        ["dtype", "step", "step ms", "GFLOP/s", "ceiling", "of ceiling", "step / GEMVs", "target"],
    )
    print_table(
        "Decode steps against both floors (matmuls at the GEMM ceiling; weights + KV read once)",
        [row for row in rows if "memory floor ms" in row],
        ["dtype", "step", "step ms", "compute floor ms", "memory floor ms", "of bound"],
    )
    payload = {
        "args": vars(args),
        "bandwidth_bytes_per_s": bandwidth,
        "read_bytes_per_s": read,
        "threads": threads,
        "ceilings": ceilings,
        "rows": rows,
    }
    write_json("roofline", payload)
    return payload


if __name__ == "__main__":
    main()
