"""One model instance against this machine's own ceilings, measured in the same run.

    python -m bench.roofline [--dtypes float32 bfloat16] [--steps 10]

Ceilings, per dtype: ``F.linear`` GFLOP/s through the model's own weight matrices (one layer's
qkv, o, gate_up and down, as the engine stores them) at M = 1, 32, 64, 256 and 2,048 rows, and
copy bandwidth (bytes read + written per second of a 1 GiB copy). Then three engine steps,
each set against the ceiling it can at best reach:

  prefill   one step of 8 x 256-token prompts (2,048 tokens)   model FLOPs / step time vs GEMM at M=2048
  decode64  a decode step of 64 sequences at ~320-token context model FLOPs / step time vs GEMM at M=64
  decode1   a decode step of one sequence at ~320 tokens       step time / the time of one batch-1 product
                                                               through every weight matrix (the "GEMVs")

Model FLOPs count the matmuls (2 x rows x params of each matrix; the LM head only for the rows
that sample) and attention (QK^T and PV: 4 x heads x head_dim per query-key pair attended).
The issue's targets: prefill >= 0.60, decode64 >= 0.50, decode1 step <= 1.25 x the GEMVs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import exact_length_prompts, print_table, write_json
from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from common.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

GEMM_ROWS = (1, 32, 64, 256, 2048)
PREFILL_PROMPTS, PREFILL_LEN = 8, 256
DECODE_BATCH, DECODE_CONTEXT = 64, 320


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


def _layer_matrices(engine: LLMEngine) -> list[torch.Tensor]:
    layer = engine.executor.driver.model.model.layers[0]
    return [
        layer.self_attn.qkv_proj.weight,
        layer.self_attn.o_proj.weight,
        layer.mlp.gate_up_proj.weight,
        layer.mlp.down_proj.weight,
    ]


def _all_matrices(engine: LLMEngine) -> list[torch.Tensor]:
    return list({id(p): p for p in engine.executor.driver.model.parameters() if p.dim() == 2}.values())


def _best_time(fn, budget_s: float = 0.3, min_runs: int = 3) -> float:
    fn()
    best, spent, runs = float("inf"), 0.0, 0
    while spent < budget_s or runs < min_runs:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return best


def gemm_rates(engine: LLMEngine) -> dict[int, float]:
    """GFLOP/s of F.linear through one layer's four matrices, per row count."""
    mats = _layer_matrices(engine)
    rates = {}
    with torch.inference_mode():
        for rows in GEMM_ROWS:
            inputs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in mats]
            flops = sum(2 * rows * w.numel() for w in mats)
            seconds = _best_time(lambda inputs=inputs: [F.linear(x, w) for x, w in zip(inputs, mats, strict=True)])
            rates[rows] = flops / seconds / 1e9
    return rates


def gemv_seconds(engine: LLMEngine) -> float:
    """One batch-1 product through every weight matrix once (the embedding's too: it is the tied LM head)."""
    mats = _all_matrices(engine)
    inputs = [torch.randn(1, w.shape[1], dtype=w.dtype) for w in mats]
    with torch.inference_mode():
        return _best_time(lambda: [F.linear(x, w) for x, w in zip(inputs, mats, strict=True)], budget_s=0.5)


def _model_flops(engine: LLMEngine, tokens: int, sampled: int, attended_pairs: int) -> float:
    shape = engine.executor.driver.shape
    per_layer = sum(w.numel() for w in _layer_matrices(engine))
    linear = 2 * tokens * per_layer * shape.num_layers + 2 * sampled * shape.vocab_size * shape.hidden_size
    attention = 4 * shape.num_heads * shape.head_dim * attended_pairs * shape.num_layers
    return float(linear + attention)


def time_prefill(engine: LLMEngine, prompts: list[list[int]], repeats: int) -> float:
    """Median seconds of one step that prefills every prompt (the step's budget holds them all)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(repeats + 1):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{r}-{i}", prompt, params)
        start = time.perf_counter()
        engine.step()
        if r:  # the first step warms the path
            times.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)


def time_decode(engine: LLMEngine, prompts: list[list[int]], num_steps: int) -> tuple[float, int]:
    """Median seconds of a pure decode step with len(prompts) sequences; returns it and the mean context."""
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.iter_live()):
        engine.step()
    engine.step()
    times, contexts = [], []
    for _ in range(num_steps):
        contexts.append(statistics.mean(r.num_tokens for r in engine.scheduler.running))
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in range(len(prompts)):
        engine.abort_request(f"d{i}")
    engine.step()
    return statistics.median(times), int(statistics.mean(contexts))


def measure(dtype: str, steps: int) -> tuple[list[dict], dict]:
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(dtype=dtype),
            cache=CacheConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=DECODE_BATCH, max_num_batched_tokens=PREFILL_PROMPTS * PREFILL_LEN),
        )
    )
    try:
        rates = gemm_rates(engine)
        gemv = gemv_seconds(engine)
        prompts = exact_length_prompts(engine.tokenizer, DECODE_BATCH, DECODE_CONTEXT - steps // 2)
        prefill_s = time_prefill(
            engine, exact_length_prompts(engine.tokenizer, PREFILL_PROMPTS, PREFILL_LEN), max(2, steps // 4)
        )
        decode64_s, context64 = time_decode(engine, prompts, steps)
        decode1_s, context1 = time_decode(engine, prompts[:1], steps)
    finally:
        engine.shutdown()
    causal_pairs = PREFILL_PROMPTS * PREFILL_LEN * (PREFILL_LEN + 1) // 2
    prefill_flops = _model_flops(engine, PREFILL_PROMPTS * PREFILL_LEN, PREFILL_PROMPTS, causal_pairs)
    decode64_flops = _model_flops(engine, DECODE_BATCH, DECODE_BATCH, DECODE_BATCH * context64)
    rows = [
        {
            "dtype": dtype,
            "step": f"prefill {PREFILL_PROMPTS}x{PREFILL_LEN}",
            "step ms": prefill_s * 1e3,
            "GFLOP/s": prefill_flops / prefill_s / 1e9,
            "ceiling": f"GEMM M=2048 {rates[2048]:.0f} GFLOP/s",
            "of ceiling": prefill_flops / prefill_s / 1e9 / rates[2048],
            "target": ">= 0.60",
        },
        {
            "dtype": dtype,
            "step": f"decode {DECODE_BATCH} seqs, ctx {context64}",
            "step ms": decode64_s * 1e3,
            "GFLOP/s": decode64_flops / decode64_s / 1e9,
            "ceiling": f"GEMM M=64 {rates[64]:.0f} GFLOP/s",
            "of ceiling": decode64_flops / decode64_s / 1e9 / rates[64],
            "target": ">= 0.50",
        },
        {
            "dtype": dtype,
            "step": f"decode 1 seq, ctx {context1}",
            "step ms": decode1_s * 1e3,
            "ceiling": f"GEMVs {gemv * 1e3:.1f} ms",
            "of ceiling": gemv / decode1_s,
            "step / GEMVs": decode1_s / gemv,
            "target": "step <= 1.25 x GEMVs",
        },
    ]
    return rows, {"gemm_gflops": rates, "gemv_seconds": gemv}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10, help="decode steps timed per batch size")
    args = parser.parse_args(argv)

    bandwidth = copy_bandwidth()
    rows, ceilings = [], {}
    for dtype in args.dtypes:
        dtype_rows, ceilings[dtype] = measure(dtype, args.steps)
        rows += dtype_rows
    threads = torch.get_num_threads()
    print(f"copy bandwidth (1 GiB, read+write): {bandwidth / 1e9:.1f} GB/s; {threads} threads")
    gemm_rows = [
        {"dtype": dtype, **{f"M={m}": ceilings[dtype]["gemm_gflops"][m] for m in GEMM_ROWS}} for dtype in args.dtypes
    ]
    print_table(
        "GEMM ceiling: F.linear GFLOP/s through one layer's weights",
        gemm_rows,
        ["dtype"] + [f"M={m}" for m in GEMM_ROWS],
    )
    print_table(
        "Engine steps against the machine's ceilings",
        rows,
        ["dtype", "step", "step ms", "GFLOP/s", "ceiling", "of ceiling", "step / GEMVs", "target"],
    )
    payload = {
        "args": vars(args),
        "bandwidth_bytes_per_s": bandwidth,
        "threads": threads,
        "ceilings": ceilings,
        "rows": rows,
    }
    write_json("roofline", payload)
    return payload


if __name__ == "__main__":
    main()
