"""Profile the engine on this machine and fit the simulator's latency model (bench.sim.latency_model).

    prefill: one step over prompts of several lengths (alone and batched)  ─▶ base + a·Σn + b·Σn²
    decode:  steady decode steps at several batch sizes and context lengths ─▶ base + c·batch + d·Σcontext

Each point is the median of a few repeats; the fit's worst relative error is printed beside it.
Writes the model as JSON (``bench/results/profile_<name>.json`` unless ``--out``), which
``bench.goodput --simulate`` and the placement search load.

    python -m bench.profile [--tp 1] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.common import RESULTS_DIR, exact_length_prompts, print_table, write_json
from bench.sim.latency_model import ProfiledModel
from common.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from common.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine


def _engine(tp: int, kv_cache_memory: int, dtype: str, model: str | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=model, dtype=dtype),
            cache=CacheConfig(kv_cache_memory=kv_cache_memory, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192),
            parallel=ParallelConfig(tensor_parallel_size=tp),
        )
    )


def _time_prefill(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    """One step that prefills every prompt (the budget holds them all) and samples their first token."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    started = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - started
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def _time_decode(engine: LLMEngine, prompts: list[list[int]], tag: str, num_steps: int) -> float:
    """Median time of a decode step once every prompt is in the running batch."""
    params = SamplingParams(temperature=0, max_tokens=num_steps + 2, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    engine.step()  # all prefills (the budget holds them), first tokens sampled
    times = []
    for _ in range(num_steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def profile(
    tp: int, quick: bool, dtype: str, kv_cache_memory: int, model: str | None = None
) -> tuple[ProfiledModel, list[dict]]:
    engine = _engine(tp, kv_cache_memory, dtype, model)
    try:
        tokenizer = engine.tokenizer
        lengths = [16, 64, 256, 512] if quick else [16, 32, 64, 128, 256, 512, 1024]
        repeats = 2 if quick else 3
        rows: list[dict] = []
        prefill_samples: list[tuple[list[int], float]] = []
        _time_prefill(engine, exact_length_prompts(tokenizer, 1, 32), "warm")
        for batch in (1, 4):
            for length in lengths:
                if batch * length > 4096:
                    continue
                prompts = exact_length_prompts(tokenizer, batch, length)
                seconds = statistics.median(
                    _time_prefill(engine, prompts, f"p{batch}-{length}-{r}") for r in range(repeats)
                )
                prefill_samples.append(([length] * batch, seconds))
                rows.append({"phase": "prefill", "batch": batch, "tokens": length, "measured_ms": seconds * 1e3})
        decode_samples: list[tuple[int, int, float]] = []
        batches = [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32]
        contexts = [64, 512] if quick else [64, 256, 1024]
        for batch in batches:
            for context in contexts:
                if batch * context > engine.kv.capacity_tokens // 2:
                    continue
                prompts = exact_length_prompts(tokenizer, batch, context)
                seconds = _time_decode(engine, prompts, f"d{batch}-{context}", num_steps=4 if quick else 8)
                decode_samples.append((batch, batch * context, seconds))
                rows.append({"phase": "decode", "batch": batch, "tokens": context, "measured_ms": seconds * 1e3})
        layout = engine.layout
        kv_bytes_per_token = layout.bytes_per_block // layout.block_size * layout.tp_size  # whole model, all shards
        capacity = engine.kv.capacity_tokens
    finally:
        engine.shutdown()
    name = f"local-{dtype}"
    model = ProfiledModel.fit_prefill(prefill_samples, tp, kv_bytes_per_token, capacity).merged(
        ProfiledModel.fit_decode(decode_samples, tp, kv_bytes_per_token, capacity)
    )
    model = ProfiledModel(model.kv_bytes_per_token, model.per_tp, name)
    for row in rows:
        if row["phase"] == "prefill":
            row["fitted_ms"] = model.prefill_time([row["tokens"]] * row["batch"], tp) * 1e3
        else:
            row["fitted_ms"] = model.decode_step_time(row["batch"], row["batch"] * row["tokens"], tp) * 1e3
        row["error"] = row["fitted_ms"] / row["measured_ms"] - 1
    return model, rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", type=int, default=512 * 2**20)
    parser.add_argument("--quick", action="store_true", help="fewer points (a minute or two)")
    parser.add_argument("--out", help="where to write the model JSON")
    args = parser.parse_args(argv)
    merged: ProfiledModel | None = None
    all_rows = []
    for tp in args.tp:
        model, rows = profile(tp, args.quick, args.dtype, args.kv_cache_memory, args.model)
        merged = model if merged is None else merged.merged(model)
        all_rows += [{"tp": tp, **row} for row in rows]
    assert merged is not None
    print_table(
        "Engine profile (fit vs measured)",
        all_rows,
        ["tp", "phase", "batch", "tokens", "measured_ms", "fitted_ms", "error"],
    )
    out = Path(args.out) if args.out else RESULTS_DIR / f"profile_{merged.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(merged.to_json())
    print(f"\nwrote the latency model to {out}")
    write_json("profile_samples", {"args": vars(args), "rows": all_rows})


if __name__ == "__main__":
    main()
