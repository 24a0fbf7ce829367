"""Offline output throughput: pdserve's engine vs transformers, side by side in one run.

    python -m bench.offline_throughput [--num-prompts 64 --input-len 128 --output-len 128 --dtypes float32 bfloat16]

For each dtype: pdserve's engine (continuous batching, paged KV), transformers' ``generate``
with static batches of the same size, and transformers' continuous batching (``generate_batch``)
where it runs on this device. Two workloads:

  fixed  every prompt asks for exactly ``output_len`` tokens (static batching's best case)
  mixed  output lengths drawn uniformly from [output_len / 8, output_len * 2] with a fixed seed;
         a static batch runs until its longest member is done, then keeps only what each asked for

Throughput counts only the tokens each request asked for.

Beside them, the job's **GEMM floor**: the seconds its matrix products alone take at this
machine's GEMM rate through the engine's own product (bench.roofline's ceilings, measured right
after pdserve's run): the prompts' tokens at M=2,048 (a prefill step's budget) and the decode
tokens at M=batch. No engine on these weights finishes the job sooner, so the largest speed-up
over transformers any engine could show here is transformers' time over the floor ("x floor").
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

import torch

from bench.common import exact_length_prompts, print_table, write_json
from bench.oracle import load_hf
from common.sampling_params import SamplingParams
from engine import LLM


def output_lengths(workload: str, num_prompts: int, output_len: int) -> list[int]:
    if workload == "fixed":
        return [output_len] * num_prompts
    rng = random.Random(0)
    return [rng.randint(max(1, output_len // 8), output_len * 2) for _ in range(num_prompts)]


def decode_attended_pairs(prompt_lens: list[int], lengths: list[int]) -> int:
    """(query, key) pairs the decode steps attend. Prefill samples the first output token; each
    of the other ``n - 1`` comes from a decode step whose query (the token before it, at position
    ``p + i - 1`` for step i) attends to ``p + i`` keys: itself and everything before it."""
    return sum(m * p + m * (m + 1) // 2 for p, m in ((p, n - 1) for p, n in zip(prompt_lens, lengths, strict=True)))


def gemm_floor(engine, prompts: list[list[int]], lengths: list[int], batch_size: int) -> tuple[float, float]:
    """(prefill, decode) seconds of the job's products at this machine's GEMM rates (attention's
    products counted at the same rate: a floor, not an estimate)."""
    from bench.roofline import Ceilings, model_flops

    ceilings = Ceilings(engine)
    prompt_lens = [len(p) for p in prompts]
    prefill_pairs = sum(n * (n + 1) // 2 for n in prompt_lens)
    prefill_flops = model_flops(engine, sum(prompt_lens), len(prompts), prefill_pairs)
    decode_tokens = sum(lengths) - len(prompts)
    decode_flops = model_flops(engine, decode_tokens, decode_tokens, decode_attended_pairs(prompt_lens, lengths))
    prefill_rows = engine.config.scheduler.max_num_batched_tokens
    decode_rows = min(batch_size, len(prompts))
    # The best of three bursts in a row: a floor must not rise because a neighbour's burst
    # slowed one measurement on this shared machine.
    rates = [(ceilings.gemm_gflops(prefill_rows, 0.3), ceilings.gemm_gflops(decode_rows, 0.3)) for _ in range(3)]
    return (
        prefill_flops / (max(r[0] for r in rates) * 1e9),
        decode_flops / (max(r[1] for r in rates) * 1e9),
    )


def run_pdserve(model_dir, prompts, lengths, dtype, batch_size) -> tuple[float, tuple[float, float]]:
    """The job's seconds, and its GEMM floor measured at once after it (prefill, decode)."""
    with LLM(str(model_dir), dtype=dtype, max_num_seqs=batch_size, kv_cache_memory=2 * 2**30) as llm:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        floor = gemm_floor(llm.engine, prompts, lengths, batch_size)
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    return elapsed, floor


def run_hf_generate(model, prompts, lengths, batch_size) -> float:
    # Equal-length prompts: static batches need no padding. A batch runs to its longest request.
    with torch.inference_mode():
        warm = torch.tensor(prompts[:2])
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i : i + batch_size])
            longest = max(lengths[i : i + batch_size])
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                do_sample=False,
                max_new_tokens=longest,
                min_new_tokens=longest,
            )
            assert out.shape[1] - batch.shape[1] == longest
        return time.perf_counter() - start


def run_hf_continuous(model, prompts, lengths, batch_size) -> float:
    """transformers' continuous batching; one call per distinct length (its config is per call)."""
    from transformers import GenerationConfig

    elapsed = 0.0
    for length in sorted(set(lengths)):
        group = [p for p, n in zip(prompts, lengths, strict=True) if n == length]
        config = GenerationConfig(
            max_new_tokens=length,
            min_new_tokens=length,
            do_sample=False,
            eos_token_id=-1,
            max_batch_tokens=max(512, batch_size * 8),
        )
        with torch.inference_mode():
            start = time.perf_counter()
            results = model.generate_batch(group, generation_config=config, progress_bar=False)
            elapsed += time.perf_counter() - start
        produced = {len(r.generated_tokens) for r in results.values()}
        assert produced == {length}, f"generate_batch produced {produced} tokens, not {length}"
    return elapsed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=None, help="engine max_num_seqs and HF batch; default all")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--workloads", nargs="+", default=["fixed", "mixed"], choices=["fixed", "mixed"])
    parser.add_argument(
        "--skip-hf-continuous",
        action="store_true",
        help="skip generate_batch (slow on CPU; it runs on the fixed workload only)",
    )
    parser.add_argument(
        "--save-prompts",
        metavar="PATH",
        help="also write the prompts' token ids as JSON, for a peer on the same inputs (bench/peer_vllm_offline.py)",
    )
    args = parser.parse_args(argv)
    batch_size = args.batch_size or args.num_prompts

    from engine.model_loader import resolve_model_dir
    from engine.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(None)
    prompts = exact_length_prompts(load_tokenizer(model_dir), args.num_prompts, args.input_len)
    if args.save_prompts:
        Path(args.save_prompts).write_text(json.dumps(prompts))
    rows = []
    for workload in args.workloads:
        lengths = output_lengths(workload, args.num_prompts, args.output_len)
        total_out = sum(lengths)
        for dtype in args.dtypes:
            ours_s, (prefill_floor, decode_floor) = run_pdserve(model_dir, prompts, lengths, dtype, batch_size)
            floor = prefill_floor + decode_floor
            timings: dict[str, float | str] = {"pdserve": ours_s}
            gc.collect()
            model = load_hf(model_dir, getattr(torch, dtype))
            timings["transformers generate"] = run_hf_generate(model, prompts, lengths, batch_size)
            if not args.skip_hf_continuous and workload == "fixed":
                try:
                    timings["transformers generate_batch"] = run_hf_continuous(model, prompts, lengths, batch_size)
                except Exception as exc:  # report why the baseline could not run; keep the others
                    timings["transformers generate_batch"] = f"n/a: {type(exc).__name__}: {str(exc)[:80]}"
            del model
            gc.collect()
            ours = total_out / float(timings["pdserve"])
            for system, elapsed in timings.items():
                row = {"workload": workload, "dtype": dtype, "system": system}
                if isinstance(elapsed, str):
                    rows.append({**row, "note": elapsed})
                    continue
                tput = total_out / elapsed
                rows.append(
                    {
                        **row,
                        "seconds": elapsed,
                        "output tok/s": tput,
                        "pdserve / this": ours / tput,
                        "x floor": elapsed / floor,
                    }
                )
            rows.append(
                {
                    "workload": workload,
                    "dtype": dtype,
                    "system": "GEMM floor",
                    "seconds": floor,
                    "note": f"prefill {prefill_floor:.1f} s + decode {decode_floor:.1f} s",
                }
            )
    print_table(
        f"Offline throughput: {args.num_prompts} prompts, {args.input_len} in / {args.output_len} out (fixed), "
        f"batch {batch_size}, {torch.get_num_threads()} threads",
        rows,
        ["workload", "dtype", "system", "seconds", "output tok/s", "pdserve / this", "x floor", "note"],
    )
    payload = {"args": vars(args), "rows": rows}
    write_json("offline_throughput", payload)
    return payload


if __name__ == "__main__":
    main()
