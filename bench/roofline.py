"""Decode-step time against the memory-bandwidth bound.

    python -m bench.roofline [--batch-sizes 1 32 --context-len 256 --dtype float32]

A decode step must read every weight once plus each sequence's KV so far. This measures the
machine's bandwidth with a large copy (bytes read + written per second), times real decode
steps of the engine at each batch size, and reports measured time as a fraction of the bound
(bound time / measured time; 1.0 would be a step running at full memory bandwidth). It also
reports the step against the "GEMV ceiling": this BLAS streaming every weight matrix once
through a batch-1 product with nothing else, the most a batch-1 step can reach here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import exact_length_prompts, print_table, write_json
from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from common.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine


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


def gemv_ceiling(engine: LLMEngine, repeats: int = 5) -> float:
    """Bytes per second of this BLAS streaming every weight matrix once through a batch-1 product,
    as a decode step does, with nothing else: the best a batch-1 step can reach here."""
    import torch.nn.functional as F

    mats = {id(p): p for p in engine.executor.driver.model.parameters() if p.dim() == 2}.values()
    inputs = {p.shape[1]: torch.randn(1, p.shape[1], dtype=p.dtype) for p in mats}
    total = sum(p.numel() * p.element_size() for p in mats)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for p in mats:
                F.linear(inputs[p.shape[1]], p)
            best = min(best, time.perf_counter() - start)
    return total / best


def weight_bytes(engine: LLMEngine) -> int:
    seen, total = set(), 0
    for param in engine.executor.driver.model.parameters():
        if id(param) not in seen:  # tied embeddings count once
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


def time_decode_steps(engine: LLMEngine, prompts: list[list[int]], num_steps: int) -> tuple[float, int]:
    """Median seconds of a pure decode step with len(prompts) sequences; returns it and the mean context."""
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.iter_live()):
        engine.step()
    engine.step()  # first all-decode step warms the path
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    context = statistics.mean(r.num_tokens for r in engine.scheduler.running)
    for i in range(len(prompts)):
        engine.abort_request(f"r{i}")
    engine.step()
    return statistics.median(times), int(context)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    bandwidth = copy_bandwidth()
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(dtype=args.dtype),
            cache=CacheConfig(kv_cache_memory=1 << 30),
            scheduler=SchedulerConfig(max_num_seqs=max(args.batch_sizes)),
        )
    )
    try:
        weights = weight_bytes(engine)
        gemv = gemv_ceiling(engine)
        kv_per_token = engine.layout.bytes_per_block // engine.layout.block_size
        prompts_all = exact_length_prompts(engine.tokenizer, max(args.batch_sizes), args.context_len)
        rows = []
        for batch in args.batch_sizes:
            step_s, context = time_decode_steps(engine, prompts_all[:batch], args.steps)
            bytes_read = weights + batch * context * kv_per_token
            bound_s = bytes_read / bandwidth
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "step ms": step_s * 1e3,
                    "bound ms": bound_s * 1e3,
                    "MB read": bytes_read / 1e6,
                    "effective GB/s": bytes_read / step_s / 1e9,
                    "fraction of bound": bound_s / step_s,
                    "of GEMV ceiling": (bytes_read / gemv) / step_s,
                    "tok/s": batch / step_s,
                }
            )
    finally:
        engine.shutdown()
    print(
        f"memory bandwidth (1 GiB copy, read+write): {bandwidth / 1e9:.1f} GB/s; batch-1 GEMV streaming every "
        f"weight once: {gemv / 1e9:.1f} GB/s; weights {weights / 1e6:.0f} MB "
        f"({args.dtype}); KV {kv_per_token} B/token; {torch.get_num_threads()} threads"
    )
    print_table(
        "Decode step vs bandwidth bound",
        rows,
        [
            "batch",
            "context",
            "step ms",
            "bound ms",
            "MB read",
            "effective GB/s",
            "fraction of bound",
            "of GEMV ceiling",
            "tok/s",
        ],
    )
    payload = {
        "args": vars(args),
        "bandwidth_bytes_per_s": bandwidth,
        "gemv_bytes_per_s": gemv,
        "weight_bytes": weights,
        "rows": rows,
    }
    write_json("roofline", payload)
    return payload


if __name__ == "__main__":
    main()
