"""The CUDA and NCCL paths, checked and timed on the GPU of this machine, in one run.

    python -m bench.cuda_check [--device cuda] [--tokenizer-dir DIR] [--prompts 64 256]

The weights are random, drawn from a fixed seed in SmolLM2-135M's shape (``bench.random_model``):
a GPU machine here cannot fetch the real ones, and none of what is checked depends on their values.

1. oracle, float32: pdserve's greedy tokens equal transformers' on the same device, token for
   token; a tiny model (4 query / 2 KV heads) and the SmolLM2-shaped one; short prompts, a long
   one in chunks, and the same prompts again through the prefix cache.
2. disaggregated, float32: a prefill engine pushes each prompt's KV chunk by chunk into a decode
   engine in this process, both caches on the GPU, over each KV backend; decoded tokens equal
   transformers'; the push's bytes and seconds (torch's GPU payloads go over NCCL, which needs the
   pair's two ranks on two GPUs: on one GPU it must fail cleanly, within the chunk's deadline).
3. tensor parallelism: a TP degree above the GPUs visible is refused with a clear error; NCCL
   comes up in a one-rank group and all-reduces.
4. speed, bfloat16: ``LLM.generate`` of N prompts of 256 tokens, 64 tokens each, against
   transformers' ``generate`` on the same batch; engine steps: prefill 8 x 256, decode at 64 and 1.

Prints a table per part and writes bench/results/cuda_check.json. Runs on CPU too (--device cpu,
small sizes), which is how it is tried before a GPU is lent.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from bench.common import RESULTS_DIR, exact_length_prompts, print_table, write_json
from bench.oracle import hf_greedy, load_hf
from bench.random_model import build_smol_shaped, build_tiny_llama
from common.config import (
    CacheConfig,
    EngineConfig,
    EngineRole,
    KVConnectorConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from common.errors import ConfigError
from common.sampling_params import SamplingParams
from engine import LLM
from engine.llm_engine import LLMEngine
from engine.tokenizer import load_tokenizer
from kv_transfer import make_ticket

CONNECTOR = "kv_transfer.connector:TransferConnector"
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(tokenizer, long_tokens: int) -> list[list[int]]:
    prompts = [tokenizer.encode(t) for t in TEXTS]
    prompts.append(exact_length_prompts(tokenizer, 1, long_tokens)[0])  # several prefill chunks
    return prompts


def check_oracle(
    name: str,
    model_dir: Path,
    device: torch.device,
    long_tokens: int,
    new_tokens: int,
    paths: dict[str, dict] | None = None,
) -> list[dict]:
    """pdserve's greedy output against transformers' on ``device``, float32; a second pass hits the
    prefix cache. ``paths``: engine options by label (e.g. the torch and Triton backends, CUDA
    graphs on and off), each checked against the same reference."""
    hf = load_hf(model_dir, torch.float32, device)
    tokenizer = load_tokenizer(model_dir)
    prompts = _prompts(tokenizer, long_tokens)
    expected = [hf_greedy(hf, ids, new_tokens) for ids in prompts]
    del hf
    rows = []
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for path, options in (paths or {"default": {}}).items():
        with LLM(
            str(model_dir),
            dtype="float32",
            device=device.type,
            kv_cache_memory=256 * 2**20,
            max_num_batched_tokens=256,
            **options,
        ) as llm:
            runner = llm.engine.executor.driver
            for attempt in ("cold", "prefix cache"):
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                for i, (ids, want, have) in enumerate(zip(prompts, expected, got, strict=True)):
                    # HF stops at EOS, pdserve (ignore_eos) does not: compare what HF produced.
                    same = list(have[: len(want)]) == want
                    rows.append(
                        {"model": name, "path": path, "pass": attempt, "prompt": i, "tokens": len(ids), "equal": same}
                    )
            # What the path really ran (a fallback would otherwise pass as the path it replaced).
            ran_as = {
                "backend": runner.attention_backend,
                "graph replays": runner.num_graph_replays,
                "overlap outputs": llm.engine.overlap_outputs,
                "steps ahead": llm.engine.num_steps_ahead,
            }
            rows = [{**r, **ran_as} if r["path"] == path else r for r in rows]
    return rows


def _engine(model_dir: Path, device: torch.device, role, backend: str, receive: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype="float32", device=str(device)),
            cache=CacheConfig(kv_cache_memory=512 * 2**20),
            scheduler=SchedulerConfig(role=role, max_prefill_chunk=256),
            parallel=ParallelConfig(tensor_parallel_size=1),
            kv_connector=KVConnectorConfig(CONNECTOR, {"backend": backend, "receive": receive}, push_every_chunk=True),
        )
    )


def expect_hand_off(
    decode: LLMEngine,
    request_id: str,
    ids: list[int],
    params: SamplingParams,
    backend: str = "inproc",
    lease_s: float = 60,
) -> dict:
    """The decode side of a hand-off: the prompt's blocks reserved and the ticket registered on every
    shard; the ticket (a dict), for the prefill engine's ``add_request``."""
    block_ids = decode.reserve(request_id, ids, params)
    ticket = make_ticket(
        request_id, backend, decode.kv_endpoints, decode.layout, decode.model_id, block_ids, len(ids), lease_s
    ).to_dict()
    decode.expect_kv(request_id, ticket)
    return ticket


def tokenizer_dir_of(given: str | None) -> Path:
    """``--tokenizer-dir``, else the prepared default model's directory."""
    if given:
        return Path(given)
    from engine.model_loader import resolve_model_dir

    return resolve_model_dir(None)


def machine_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "device": str(device), "cpus": os.cpu_count()}
    if device.type == "cuda":
        info |= {
            "gpu": torch.cuda.get_device_name(device),
            "cuda": torch.version.cuda,
            "gpus": torch.cuda.device_count(),
        }
    return info


def disagg_pair(model_dir: Path, device: torch.device, backend: str, prompts, expected, new_tokens: int) -> dict:
    prefill = _engine(model_dir, device, EngineRole.PREFILL, backend, receive=False)
    decode = _engine(model_dir, device, EngineRole.DECODE, backend, receive=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for i, ids in enumerate(prompts):
            prefill.add_request(f"r{i}", ids, params, kv_ticket=expect_hand_off(decode, f"r{i}", ids, params, backend))
        finished: dict = {}
        start = time.perf_counter()
        while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
            if time.perf_counter() - start > 120:
                raise TimeoutError("the pair did not finish in 120 s")
            prefill.step()
            finished.update({o.request_id: o for o in decode.step() if o.finished})
        errors = [finished[f"r{i}"].error for i in range(len(prompts)) if finished[f"r{i}"].error]
        equal = (
            all(list(finished[f"r{i}"].outputs[0].token_ids[: len(want)]) == want for i, want in enumerate(expected))
            and not errors
        )
        sent = [prefill.transfers_sent[f"r{i}"] for i in range(len(prompts)) if f"r{i}" in prefill.transfers_sent]
        long = sent[-1] if sent else None
        return {
            "backend": backend,
            "equal": equal,
            "errors": errors[0][:120] if errors else "",
            "long prompt MB": long.num_bytes / 1e6 if long else None,
            "long push s": long.seconds if long else None,
            "GB/s": long.num_bytes / long.seconds / 1e9 if long and long.seconds else None,
            "blocks left": prefill.num_blocks_held() + decode.num_blocks_held(),
        }
    finally:
        prefill.shutdown()
        decode.shutdown()


def check_disagg(model_dir: Path, device: torch.device, backends: list[str], long_tokens: int, new_tokens: int):
    hf = load_hf(model_dir, torch.float32, device)
    prompts = _prompts(load_tokenizer(model_dir), long_tokens)
    expected = [hf_greedy(hf, ids, new_tokens) for ids in prompts]
    del hf
    rows = []
    for backend in backends:
        outcome: dict = {}

        def run(backend=backend, outcome=outcome) -> None:
            try:
                outcome.update(disagg_pair(model_dir, device, backend, prompts, expected, new_tokens))
            except Exception as exc:
                outcome.update({"backend": backend, "equal": False, "errors": f"{type(exc).__name__}: {exc}"[:200]})
                traceback.print_exc()

        # A transport that hangs must not take the rest of the run with it.
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(180)
        rows.append(
            outcome if not thread.is_alive() else {"backend": backend, "equal": False, "errors": "hung > 180 s"}
        )
        print_table("disaggregated so far", rows, ["backend", "equal", "errors", "long prompt MB", "GB/s"])
    return rows


def check_tensor_parallel(model_dir: Path, device: torch.device) -> list[dict]:
    rows = []
    visible = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda":
        try:
            LLM(str(model_dir), tensor_parallel_size=visible + 1, device="cuda").shutdown()
            rows.append({"check": f"TP={visible + 1} on {visible} GPU(s)", "result": "NOT refused"})
        except ConfigError as exc:
            rows.append({"check": f"TP={visible + 1} on {visible} GPU(s)", "result": f"refused: {exc}"})
        import torch.distributed as dist

        store = dist.HashStore()
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        try:
            x = torch.ones(64 * 2**20, device=device)
            dist.all_reduce(x)
            _sync(device)
            start = time.perf_counter()
            for _ in range(10):
                dist.all_reduce(x)
            _sync(device)
            rows.append(
                {
                    "check": f"NCCL {torch.cuda.nccl.version()} one-rank all_reduce 256 MB",
                    "result": f"ok, {(time.perf_counter() - start) / 10 * 1e3:.2f} ms, sum {x[0].item():.0f}",
                }
            )
        finally:
            dist.destroy_process_group()
    return rows


def _step_ms(engine: LLMEngine, device: torch.device, steps: int) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    return (time.perf_counter() - start) / steps * 1e3


def _bf16_engine(model_dir: Path, device: torch.device) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype="bfloat16", device=device.type),
            cache=CacheConfig(kv_cache_memory=2 * 2**30, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
        )
    )


def engine_steps(model_dir: Path, device: torch.device, prompts: list[list[int]]) -> dict:
    """ms of one prefill step of 8 x 256 tokens and of decode steps at batch 64 and 1."""
    engine = _bf16_engine(model_dir, device)
    try:
        out: dict = {}
        long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
        for rep in range(4):  # the first is warm-up
            for i in range(8):
                engine.add_request(f"p{rep}-{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=1))
            ms = _step_ms(engine, device, 1)
            while engine.has_unfinished_requests():
                engine.step()
            if rep:  # the first is warm-up
                out["prefill 8x256 ms"] = min(out.get("prefill 8x256 ms", ms), ms)
        for batch in (64, 1):
            for i in range(batch):
                engine.add_request(f"d{batch}-{i}", prompts[i % len(prompts)], long)
            for _ in range(20):  # every prompt in, a few decode steps run
                engine.step()
            out[f"decode{batch} ms"] = _step_ms(engine, device, 20)
            for i in range(batch):
                engine.abort_request(f"d{batch}-{i}")
            while engine.has_unfinished_requests():
                engine.step()
        return out
    finally:
        engine.shutdown()


def profile_decode(model_dir: Path, device: torch.device, prompts: list[list[int]], steps: int = 10) -> list[dict]:
    """Where a decode step at batch 64 spends its time: torch.profiler over ``steps`` steps, the
    kernels launched and the device's busy time per step against the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    engine = _bf16_engine(model_dir, device)
    try:
        long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
        for i in range(64):
            engine.add_request(f"d{i}", prompts[i % len(prompts)], long)
        for _ in range(20):
            engine.step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            wall_ms = _step_ms(engine, device, steps)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=15))
        kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
        busy_us = sum(getattr(e, "device_time", 0.0) or 0.0 for e in kernels)
        return [
            {
                "step ms": wall_ms,
                "kernels per step": len(kernels) / steps,
                "device busy ms per step": busy_us / 1e3 / steps,
            }
        ]
    finally:
        engine.shutdown()


def speed(model_dir: Path, device: torch.device, sizes: list[int], input_len: int, output_len: int) -> list[dict]:
    tokenizer = load_tokenizer(model_dir)
    rows = []
    for n in sizes:
        prompts = exact_length_prompts(tokenizer, n, input_len)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        with LLM(
            str(model_dir), dtype="bfloat16", device=device.type, max_num_seqs=n, kv_cache_memory=4 * 2**30
        ) as llm:
            llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
            _sync(device)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            ours = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
        hf = load_hf(model_dir, torch.bfloat16, device)
        batch = torch.tensor(prompts, device=device)
        kwargs = {"attention_mask": torch.ones_like(batch), "do_sample": False}
        with torch.inference_mode():
            hf.generate(batch[:2], max_new_tokens=4, **kwargs | {"attention_mask": torch.ones_like(batch[:2])})
            _sync(device)
            start = time.perf_counter()
            hf.generate(batch, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
            _sync(device)
            theirs = time.perf_counter() - start
        del hf
        rows.append(
            {
                "prompts": n,
                "pdserve s": ours,
                "pdserve req/s": n / ours,
                "pdserve out tok/s": n * output_len / ours,
                "transformers s": theirs,
                "pdserve / transformers": theirs / ours,
            }
        )
        print_table("speed so far", rows, list(rows[-1]))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokenizer-dir", help="where SmolLM2's tokenizer files are (default: the prepared model)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[64, 256], help="batch sizes of the speed run")
    parser.add_argument("--long-tokens", type=int, default=700, help="the long prompt of the oracle checks")
    parser.add_argument("--backends", nargs="+", default=["inproc", "shm", "tcp", "grpc", "auto", "torch"])
    parser.add_argument("--parts", nargs="+", default=["oracle", "tp", "speed", "disagg"])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tokenizer_dir = tokenizer_dir_of(args.tokenizer_dir)
    info = machine_info(device)
    print(info)
    result: dict = {"info": info}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_llama(Path(tmp) / "tiny", tokenizer_dir)
        smol = build_smol_shaped(Path(tmp) / "smol", tokenizer_dir)
        parts = {
            "oracle": lambda: (
                check_oracle("tiny", tiny, device, args.long_tokens, 24)
                + check_oracle("smol-shaped", smol, device, args.long_tokens, 24)
            ),
            "disagg": lambda: check_disagg(smol, device, args.backends, args.long_tokens, 16),
            "tp": lambda: check_tensor_parallel(tiny, device),
            "profile": lambda: profile_decode(smol, device, exact_length_prompts(load_tokenizer(smol), 64, 256)),
            "speed": lambda: [
                engine_steps(smol, device, exact_length_prompts(load_tokenizer(smol), 64, 256)),
                *speed(smol, device, args.prompts, 256, 64),
            ],
        }
        for name in args.parts:
            start = time.perf_counter()
            try:
                rows = parts[name]()
            except Exception as exc:
                traceback.print_exc()
                rows = [{"error": f"{type(exc).__name__}: {exc}"[:300]}]
            result[name] = rows
            columns = sorted({k for r in rows for k in r}, key=lambda k: next(i for i, r in enumerate(rows) if k in r))
            print_table(f"{name} ({time.perf_counter() - start:.0f} s)", rows, columns)
            write_json("cuda_check", result)
    out = os.environ.get("OUT")
    if out:
        Path(out, "cuda_check.json").write_text((RESULTS_DIR / "cuda_check.json").read_text())
    return result


if __name__ == "__main__":
    main()
    os._exit(0)  # a hung transport's thread must not hold the process
