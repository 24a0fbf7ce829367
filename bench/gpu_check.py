"""The one-command GPU check: hard checks that fail the run, and the figures a GPU user asks for.

    python -m bench.gpu_check [--tokenizer-dir DIR] [--parts ...] [--big-layers 4]

Exits 1 when any hard check fails (or a part raises), 0 only when every one passed; prints a
table per part and writes bench/results/gpu_check.json (and $OUT/gpu_check.json where OUT is
set). It needs only torch with CUDA, transformers, safetensors, msgpack and numpy: no Ray and no
network. Weights are random, from fixed seeds, in real models' shapes (``bench.random_model``);
the SmolLM2 tokenizer files must be beside it (``--tokenizer-dir``, ~3.5 MB). KV transports whose
own packages are missing (grpc without grpcio) are reported skipped, not failed.

Hard checks:
- oracle: float32 greedy output equal to transformers' on the GPU, token for token (a tiny model
  with 4 query / 2 KV heads and the SmolLM2-shaped one; short prompts, a long one in chunks, the
  same again through the prefix cache), on each engine path (torch eager, Triton eager, Triton
  with decode steps replayed as CUDA graphs), each row also failing if the engine fell back from
  the path it names;
- bf16: teacher-forced argmax agreement with transformers' bfloat16 >= 0.95, SmolLM2-shaped;
- sampler: every branch (greedy, temperature, top-k, top-p, min-p, penalties, logprobs, seeded)
  runs on the GPU; a seeded request gives the same tokens alone and in a batch;
- disagg: a prefill engine pushes each prompt's KV into a decode engine, both caches on the GPU,
  over every transport; tokens equal transformers', 0 blocks held on either side. The torch
  (NCCL) transport runs across two GPUs where there are two (decode on cuda:1), and must fail
  cleanly with one;
- tp: a TP degree above the GPUs is refused; with >= 2 GPUs, TP=2 greedy equals transformers'.

Figures (not bars): the GPU's HBM bandwidth, measured (a device-to-device copy); decode steps at
batch 1 and 64 against their HBM floor (weights + KV bytes read / bandwidth) for the SmolLM2-shaped
model and an 8B-Llama-shaped one (``--big-layers`` of its 32 layers, SmolLM2's vocabulary), with
kernels launched per step; peak attention memory of a 2,048-token chunk after 6,144 tokens of
context; the prefill step's time with its KV pushed (inproc) against the same step without.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench import cuda_check
from bench.bf16_drift import teacher_forced_logits
from bench.common import exact_length_prompts, print_table, write_json
from bench.oracle import hf_greedy, load_hf
from bench.random_model import build_smol_shaped, build_tiny_llama
from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from common.errors import ConfigError
from common.sampling_params import SamplingParams
from engine import LLM
from engine.distributed.parallel import TensorParallel
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.tokenizer import load_tokenizer

BF16_AGREEMENT_BAR = 0.95
# Llama-3-8B's layer (its config.json); the vocabulary stays SmolLM2's (the tokenizer carried).
LLAMA_8B_LAYER = {"hidden_size": 4096, "intermediate_size": 14336, "num_heads": 32, "num_kv_heads": 8}


class CheckFailed(Exception):
    """A hard check's verdict: the run exits 1."""


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --- hard checks: each returns its rows, each row with "ok" ------------------------------------


def oracle(tiny: Path, smol: Path, device: torch.device, long_tokens: int) -> list[dict]:
    rows = cuda_check.check_oracle("tiny", tiny, device, long_tokens, 24, PATHS)
    rows += cuda_check.check_oracle("smol-shaped", smol, device, long_tokens, 24, PATHS)
    return [{**r, "ok": r["equal"] and ran_as_named(r)} for r in rows]


def ran_as_named(row: dict) -> bool:
    """The engine ran the path the row names: its attention backend, decode steps replayed as
    graphs on the graphs path only (a failed Triton self-check or capture falls back quietly), and
    steps queued ahead of their reads on every path (async scheduling, CUDA's default)."""
    backend = "torch" if row["path"].startswith("torch") else "triton"
    graphs = row["path"].endswith("graphs")
    ran_ahead = row.get("steps ahead", 0) > 0
    return row.get("backend") == backend and (row.get("graph replays", 0) > 0) == graphs and ran_ahead


def bf16_agreement(smol: Path, device: torch.device) -> list[dict]:
    tokenizer = load_tokenizer(smol)
    sequences = exact_length_prompts(tokenizer, 3, 320)
    config = EngineConfig(
        model=ModelConfig(model=str(smol), dtype="bfloat16", device=str(device)),
        cache=CacheConfig(kv_cache_memory=256 * 2**20),
    )
    runner = ModelRunner(config, smol, TensorParallel.single(device))
    with torch.inference_mode():
        ours = teacher_forced_logits(runner, sequences, 256).argmax(-1).cpu()
        hf = load_hf(smol, torch.bfloat16, device)
        theirs = hf(torch.tensor(sequences, device=device)).logits[:, :-1].argmax(-1).cpu()
    share = (ours == theirs).float().mean().item()
    return [
        {"positions": ours.numel(), "agreement": share, "bar": BF16_AGREEMENT_BAR, "ok": share >= BF16_AGREEMENT_BAR}
    ]


SAMPLER_BRANCHES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top-k": SamplingParams(temperature=0.8, top_k=20),
    "top-p": SamplingParams(temperature=0.8, top_p=0.9),
    "min-p": SamplingParams(temperature=0.8, min_p=0.1),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
    "logprobs": SamplingParams(temperature=0.8, logprobs=3),
    "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=1234),
}


def sampler(smol: Path, device: torch.device) -> list[dict]:
    """Every branch in one batch on the GPU, then the seeded request again alone: same tokens."""
    prompt = load_tokenizer(smol).encode("The capital of France is")
    rows = []
    with LLM(str(smol), dtype="bfloat16", device=str(device), kv_cache_memory=256 * 2**20) as llm:
        params = [dataclasses.replace(p, max_tokens=12, ignore_eos=True) for p in SAMPLER_BRANCHES.values()]
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        for name, out in zip(SAMPLER_BRANCHES, outs, strict=True):
            completion = out.outputs[0]
            ok = len(completion.token_ids) == 12 and not out.error
            if name == "logprobs":
                ok = ok and completion.logprobs is not None and len(completion.logprobs) == 12
            rows.append({"branch": name, "tokens": len(completion.token_ids), "error": out.error or "", "ok": ok})
        alone = llm.generate([prompt], params[-1], use_tqdm=False)[0].outputs[0].token_ids
        rows.append(
            {"branch": "seeded, alone = in batch", "tokens": len(alone), "ok": alone == outs[-1].outputs[0].token_ids}
        )
        rows.append(_constrained(llm, prompt))
    return rows


def _constrained(llm: LLM, prompt: list[int]) -> dict:
    """A JSON schema held on the GPU (the token masks applied to CUDA logits), greedy and seeded,
    by random weights: every answer parses, with the schema's keys and types."""
    from common.structured_outputs import ConstraintKind, StructuredOutput

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    constraint = StructuredOutput(ConstraintKind.JSON, json.dumps(schema))
    params = [SamplingParams(temperature=t, seed=7, max_tokens=64, structured_output=constraint) for t in (0.0, 1.0)]
    parsed = 0
    for out in llm.generate([prompt] * 2, params, use_tqdm=False):
        try:
            value = json.loads(out.outputs[0].text)
            parsed += set(value) == {"name", "n"} and isinstance(value["n"], int) and isinstance(value["name"], str)
        except ValueError:
            pass
    return {"branch": "json schema (token masks on the GPU)", "tokens": parsed, "ok": parsed == 2}


def disagg(smol: Path, device: torch.device, long_tokens: int) -> list[dict]:
    backends = ["inproc", "shm", "tcp", "auto"]
    skipped = []
    try:
        import grpc  # noqa: F401

        backends.append("grpc")
    except ImportError:
        skipped.append({"backend": "grpc", "ok": True, "errors": "skipped: grpcio is not installed"})
    rows = cuda_check.check_disagg(smol, device, backends, long_tokens, 16)
    rows = [{**r, "ok": bool(r.get("equal")) and r.get("blocks left") == 0 and not r.get("errors")} for r in rows]
    if gpus() >= 2:
        rows.append(nccl_pair(smol, long_tokens))
    else:
        (one,) = cuda_check.check_disagg(smol, device, ["torch"], long_tokens, 16)
        # NCCL refuses a pair's two ranks on one GPU: every request must end in an error, nothing held.
        refused = not one.get("equal") and "KV transfer failed" in str(one.get("errors"))
        rows.append({**one, "ok": refused and one.get("blocks left") == 0, "note": "one GPU: must fail cleanly"})
    return rows + skipped


def nccl_pair(smol: Path, long_tokens: int) -> dict:
    """The torch transport's NCCL path across two GPUs: prefill on cuda:0, decode on cuda:1."""
    real_engine = cuda_check._engine

    def on_two_gpus(model_dir, device, role, backend, receive):
        gpu = torch.device("cuda", 1 if receive else 0)
        return real_engine(model_dir, gpu, role, backend, receive)

    cuda_check._engine = on_two_gpus
    try:
        (row,) = cuda_check.check_disagg(smol, torch.device("cuda", 0), ["torch"], long_tokens, 16)
    finally:
        cuda_check._engine = real_engine
    return {**row, "backend": "torch (NCCL, cuda:0 -> cuda:1)", "ok": row.get("equal") and row.get("blocks left") == 0}


def tensor_parallel(tiny: Path, device: torch.device) -> list[dict]:
    visible = gpus()
    rows = []
    try:
        LLM(str(tiny), tensor_parallel_size=visible + 1, device="cuda").shutdown()
        rows.append({"check": f"TP={visible + 1} on {visible} GPU(s) refused", "ok": False})
    except ConfigError as exc:
        rows.append({"check": f"TP={visible + 1} on {visible} GPU(s) refused", "detail": str(exc)[:80], "ok": True})
    if visible >= 2:
        hf = load_hf(tiny, torch.float32, device)
        prompts = cuda_check._prompts(load_tokenizer(tiny), 300)
        expected = [hf_greedy(hf, ids, 16) for ids in prompts]
        del hf
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        with LLM(str(tiny), dtype="float32", device="cuda", tensor_parallel_size=2, max_num_batched_tokens=128) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        equal = all(list(g[: len(w)]) == w for g, w in zip(got, expected, strict=True))
        rows.append({"check": "TP=2 over NCCL, greedy = transformers", "ok": equal})
    return rows


# --- figures --------------------------------------------------------------------------------


def hbm_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), best of 10."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        dst.copy_(src)
        _sync()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


# The engine's paths on CUDA, each held to transformers' tokens: the torch backend (eager), the
# Triton kernels eager, and the default (Triton, decode steps replayed as CUDA graphs).
PATHS = {
    "torch eager": {"attention_backend": "torch", "enforce_eager": True},
    "triton eager": {"attention_backend": "triton", "enforce_eager": True},
    "triton graphs": {},
}


def decode_floor(name: str, model_dir: Path, device: torch.device, bandwidth: float, context: int) -> list[dict]:
    """Decode steps at batch 1 and 64 (``context`` tokens each) against weights + KV bytes /
    bandwidth, on each path of ``PATHS``."""
    rows = []
    for path, options in PATHS.items():
        rows += _decode_floor(name, model_dir, device, bandwidth, context, path, options)
    return rows


def _decode_floor(
    name: str, model_dir: Path, device: torch.device, bandwidth: float, context: int, path: str, options: dict
) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    prompts = exact_length_prompts(load_tokenizer(model_dir), 64, context)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype="bfloat16", device=str(device), **options),
            cache=CacheConfig(kv_cache_memory=0.5, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
        )
    )
    try:
        runner = engine.executor.driver
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        shape = runner.shape
        kv_bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
        rows = []
        long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
        for batch in (1, 64):
            for i in range(batch):
                engine.add_request(f"{name}-{batch}-{i}", prompts[i], long)
            while any(r.num_computed_tokens < context for r in engine.scheduler.running) or engine.scheduler.waiting:
                engine.step()
            for _ in range(3):
                engine.step()
            step_ms = cuda_check._step_ms(engine, device, 20)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                cuda_check._step_ms(engine, device, 5)
            kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
            floor_ms = (weight_bytes + batch * (context + 10) * kv_bytes_per_token) / bandwidth * 1e3
            capture = runner.graph_capture
            rows.append(
                {
                    "model": name,
                    "path": path,
                    "graph capture s": capture.seconds if capture else None,
                    "graph MiB": capture.memory_bytes / 2**20 if capture else None,
                    "layers": shape.num_layers,
                    "batch": batch,
                    "context": context,
                    "step ms": step_ms,
                    "HBM floor ms": floor_ms,
                    "x floor": step_ms / floor_ms,
                    "kernels per step": len(kernels) / 5,
                }
            )
            for i in range(batch):
                engine.abort_request(f"{name}-{batch}-{i}")
            while engine.has_unfinished_requests():
                engine.step()
        return rows
    finally:
        engine.shutdown()


def peak_attention_memory(device: torch.device) -> list[dict]:
    """One layer's attention for a 2,048-token chunk after 6,144 tokens of context (a later chunk,
    the shape of a long prompt's last chunk or a prefix-cache hit): the memory it allocates."""
    from engine.attention.torch_paged import attend_after_context

    heads, kv_heads, head_dim, context, chunk = 32, 8, 128, 8192, 2048
    query = torch.randn(1, heads, chunk, head_dim, device=device, dtype=torch.bfloat16)
    keys, values = (torch.randn(1, kv_heads, context, head_dim, device=device, dtype=torch.bfloat16) for _ in "kv")
    _sync()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    attend_after_context(query, keys, values, context, None, head_dim**-0.5)
    _sync()
    peak = torch.cuda.max_memory_allocated(device) - base
    scores = heads * chunk * context * 4  # what the math path would hold in float32
    return [
        {
            "shape": f"{heads}/{kv_heads} heads, {chunk} after {context - chunk}",
            "peak MB": peak / 1e6,
            "math path MB": scores / 1e6,
        }
    ]


def push_overhead(smol: Path, device: torch.device) -> list[dict]:
    """A prefill step of 8 x 256 tokens, alone and with its KV pushed (inproc) to a decode engine."""
    prompts = exact_length_prompts(load_tokenizer(smol), 8, 256)
    rows = []
    for pushed in (False, True):
        prefill = cuda_check._engine(smol, device, cuda_check.EngineRole.PREFILL, "inproc", receive=False)
        decode = cuda_check._engine(smol, device, cuda_check.EngineRole.DECODE, "inproc", receive=True)
        try:
            best = float("inf")
            for rep in range(3):
                params = SamplingParams(temperature=0.0, max_tokens=1)
                for i, ids in enumerate(prompts):
                    rid = f"{rep}-{i}"
                    ticket = cuda_check.expect_hand_off(decode, rid, ids, params, "inproc") if pushed else None
                    prefill.add_request(rid, ids, params, kv_ticket=ticket)
                _sync()
                start = time.perf_counter()
                while prefill.has_unfinished_requests():
                    prefill.step()
                _sync()
                best = min(best, time.perf_counter() - start) if rep else best
                while decode.has_unfinished_requests():
                    decode.step()
            rows.append({"KV pushed": pushed, "prefill 8x256 ms": best * 1e3})
        finally:
            prefill.shutdown()
            decode.shutdown()
    rows[-1]["overhead"] = rows[-1]["prefill 8x256 ms"] / rows[0]["prefill 8x256 ms"] - 1
    return rows


# --- the run --------------------------------------------------------------------------------


def run_parts(parts: dict[str, Callable[[], list[dict]]], hard: set[str]) -> tuple[dict, list[str]]:
    """Each part's rows; the hard parts whose rows are not all ok (or that raised) are failures."""
    result: dict = {}
    failed: list[str] = []
    for name, part in parts.items():
        start = time.perf_counter()
        try:
            rows = part()
        except Exception as exc:
            traceback.print_exc()
            rows = [{"error": f"{type(exc).__name__}: {exc}"[:300], "ok": False}]
        if name in hard and not all(r.get("ok") for r in rows):
            failed.append(name)
        result[name] = rows
        columns = sorted({k for r in rows for k in r}, key=lambda k: next(i for i, r in enumerate(rows) if k in r))
        print_table(f"{name} ({time.perf_counter() - start:.0f} s){' FAILED' if name in failed else ''}", rows, columns)
    return result, failed


HARD = {"oracle", "bf16", "sampler", "disagg", "tp"}
FIGURES = {"bandwidth", "floor", "attention_memory", "push_overhead"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokenizer-dir", help="SmolLM2's tokenizer files (default: the prepared model)")
    parser.add_argument("--parts", nargs="+", default=[*sorted(HARD), *sorted(FIGURES)])
    parser.add_argument("--long-tokens", type=int, default=700)
    parser.add_argument("--big-layers", type=int, default=4, help="layers of the 8B-shaped model (of 32)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tokenizer_dir = cuda_check.tokenizer_dir_of(args.tokenizer_dir)
    info = cuda_check.machine_info(device)
    print(info)
    with tempfile.TemporaryDirectory() as tmp:
        # Built when a part first needs them (the SmolLM2-shaped one is ~0.5 GB to write).
        tiny = functools.cache(lambda: build_tiny_llama(Path(tmp) / "tiny", tokenizer_dir))
        smol = functools.cache(lambda: build_smol_shaped(Path(tmp) / "smol", tokenizer_dir))
        bandwidth: list[float] = []

        def measured_bandwidth() -> float:
            if not bandwidth:
                bandwidth.append(hbm_bandwidth(device))
            return bandwidth[0]

        def floor() -> list[dict]:
            big = build_tiny_llama(
                Path(tmp) / "llama8b",
                tokenizer_dir,
                num_heads=LLAMA_8B_LAYER["num_heads"],
                num_kv_heads=LLAMA_8B_LAYER["num_kv_heads"],
                hidden_size=LLAMA_8B_LAYER["hidden_size"],
                intermediate_size=LLAMA_8B_LAYER["intermediate_size"],
                num_hidden_layers=args.big_layers,
                max_position_embeddings=8192,
                weight_std=0.02,
            )
            return decode_floor("smol-shaped", smol(), device, measured_bandwidth(), 320) + decode_floor(
                f"8B-shaped ({args.big_layers} of 32 layers)", big, device, measured_bandwidth(), 1024
            )

        available = {
            "oracle": lambda: oracle(tiny(), smol(), device, args.long_tokens),
            "bf16": lambda: bf16_agreement(smol(), device),
            "sampler": lambda: sampler(smol(), device),
            "disagg": lambda: disagg(smol(), device, args.long_tokens),
            "tp": lambda: tensor_parallel(tiny(), device),
            "bandwidth": lambda: [{"HBM GB/s": measured_bandwidth() / 1e9}],
            "floor": floor,
            "attention_memory": lambda: peak_attention_memory(device),
            "push_overhead": lambda: push_overhead(smol(), device),
        }
        unknown = set(args.parts) - set(available)
        if unknown:
            parser.error(f"unknown parts {sorted(unknown)}; choose from {sorted(available)}")
        result, failed = run_parts({name: available[name] for name in args.parts}, HARD)
    result = {"info": info, **result, "failed": failed, "passed": not failed}
    path = write_json("gpu_check", result)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check.json").write_text(path.read_text())
    print(json.dumps({"failed": failed, "passed": not failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    status = main()
    os._exit(status)  # a hung transport's thread must not hold the process, nor turn a failure into 0
