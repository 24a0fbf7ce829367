"""bench.gpu_check is the one command a GPU session runs: it must fail (exit non-zero) when a hard
check fails, and need nothing a bare GPU machine lacks. Its parts run on CPU here, small."""

from __future__ import annotations

import subprocess
import sys

import torch

from bench import gpu_check
from engine import llm_engine
from engine.sampler import make_generator

CPU = torch.device("cpu")


def test_the_sampler_check_passes_and_catches_a_seed_that_is_not_kept(smol_dir, tiny_dir, monkeypatch, capsys):
    rows = gpu_check.sampler(tiny_dir, CPU)
    constrained = "json schema (token masks on the GPU)"
    assert [r["branch"] for r in rows] == [*gpu_check.SAMPLER_BRANCHES, "seeded, alone = in batch", constrained]
    assert all(r["ok"] for r in rows), rows
    # Masks that allow every token: a random-weight model's answers do not parse, and the check says so.
    from engine.structured_output import manager

    monkeypatch.setattr(manager.StructuredOutputManager, "fill_bitmask", lambda self, requests, vocab_size: None)
    assert not gpu_check.sampler(tiny_dir, CPU)[-1]["ok"]
    monkeypatch.undo()
    # A generator that forgets its seed: the seeded request differs alone and in a batch.
    counter = iter(range(10**6))
    monkeypatch.setattr(llm_engine, "make_generator", lambda seed, device: make_generator(next(counter), device))
    # The whole command, on the tiny model in place of the SmolLM2-shaped one (the part's logic is the same).
    monkeypatch.setattr(gpu_check, "build_smol_shaped", lambda out_dir, tokenizer_dir: tiny_dir)
    assert gpu_check.main(["--device", "cpu", "--tokenizer-dir", str(smol_dir), "--parts", "sampler"]) == 1
    assert '"passed": false' in capsys.readouterr().out


def test_a_part_that_raises_fails_the_run_and_figures_never_do(monkeypatch):
    def broken() -> list[dict]:
        raise RuntimeError("CUDA error: an illegal memory access")

    result, failed = gpu_check.run_parts(
        {"oracle": broken, "floor": lambda: [{"step ms": 1.0}], "sampler": lambda: [{"ok": True}]}, gpu_check.HARD
    )
    assert failed == ["oracle"] and "illegal memory access" in result["oracle"][0]["error"]


def test_the_disagg_check_passes_on_cpu_over_the_transports_and_runs_without_ray_or_grpc(tiny_dir):
    """Run in a process of its own: the transports and engines it starts must not import Ray, gRPC,
    OpenTelemetry or Prometheus (none is on a bare GPU machine), and the rows must all pass."""
    probe = (
        "import sys, torch; from pathlib import Path; from bench import gpu_check; "
        f"rows = gpu_check.cuda_check.check_disagg(Path({str(tiny_dir)!r}), torch.device('cpu'), "
        "['inproc', 'shm', 'tcp', 'auto'], 80, 6); "
        "assert all(r['equal'] and r['blocks left'] == 0 for r in rows), rows; "
        "absent = {'ray', 'grpc', 'opentelemetry', 'prometheus_client'}; "
        "extra = sorted({m.split('.')[0] for m in sys.modules} & absent); "
        "print('EXTRA', extra)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "EXTRA []" in result.stdout, result.stdout[-500:]


def test_an_oracle_row_fails_when_the_engine_fell_back_from_the_path_it_names():
    row = {"equal": True, "backend": "triton", "graph replays": 40, "steps ahead": 30}
    assert gpu_check.ran_as_named({**row, "path": "triton graphs"})
    assert not gpu_check.ran_as_named({**row, "path": "triton graphs", "steps ahead": 0})  # ran in step
    assert not gpu_check.ran_as_named({**row, "path": "triton graphs", "graph replays": 0})  # capture failed
    assert not gpu_check.ran_as_named({**row, "path": "triton graphs", "backend": "torch"})  # self-check failed
    assert not gpu_check.ran_as_named({**row, "path": "triton eager"})  # enforce_eager ignored
    assert gpu_check.ran_as_named({**row, "path": "torch eager", "backend": "torch", "graph replays": 0})
    assert not gpu_check.ran_as_named(
        {**row, "path": "torch eager", "backend": "torch", "graph replays": 0, "steps ahead": 0}
    )
    assert set(gpu_check.PATHS) == {"torch eager", "triton eager", "triton graphs"}
