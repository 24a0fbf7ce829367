"""dtype=auto: the probe's decision rule, the pin, and one dtype for every shard and replica."""

from __future__ import annotations

import dataclasses

import torch

from engine import dtype_probe
from engine.dtype_probe import BFLOAT16_MARGIN, DtypeProbe, probe_cpu_matmul, resolve_auto_dtype
from engine.model_runner import resolve_dtype


def test_bfloat16_only_when_it_wins_by_the_margin():
    assert DtypeProbe(float32_gflops=200, bfloat16_gflops=470).choice == "bfloat16"  # a CPU with AMX
    assert DtypeProbe(float32_gflops=240, bfloat16_gflops=30).choice == "float32"  # emulated bf16
    assert DtypeProbe(float32_gflops=200, bfloat16_gflops=200 * BFLOAT16_MARGIN * 0.99).choice == "float32"


def test_the_probe_measures_both_dtypes_on_this_machine(monkeypatch):
    monkeypatch.delenv("PDSERVE_CPU_AUTO_DTYPE", raising=False)
    probe = probe_cpu_matmul.__wrapped__(budget_s=0.01)
    assert probe.float32_gflops > 0 and probe.bfloat16_gflops > 0
    assert resolve_auto_dtype(torch.device("cpu")) == probe_cpu_matmul().choice


def test_pinned_and_cuda_choices_skip_the_probe(monkeypatch):
    def no_probe(*args, **kwargs):
        raise AssertionError("probed")

    monkeypatch.setattr(dtype_probe, "probe_cpu_matmul", no_probe)
    monkeypatch.setenv("PDSERVE_CPU_AUTO_DTYPE", "bfloat16")
    assert resolve_auto_dtype(torch.device("cpu")) == "bfloat16"
    monkeypatch.setenv("PDSERVE_CPU_AUTO_DTYPE", "float32")
    assert resolve_auto_dtype(torch.device("cpu")) == "float32"
    assert resolve_auto_dtype(torch.device("cuda")) == "bfloat16"


def test_a_local_cpu_cluster_resolves_auto_once_for_all_replicas(monkeypatch):
    from cluster.app import with_resolved_dtype
    from cluster.cluster_config import ClusterConfig

    monkeypatch.setenv("PDSERVE_CPU_AUTO_DTYPE", "bfloat16")
    config = with_resolved_dtype(ClusterConfig(device="cpu"))
    assert config.dtype == "bfloat16"
    assert {config.engine_config(p).model.dtype for p in config.pools()} == {"bfloat16"}
    explicit = ClusterConfig(device="cpu", dtype="float32")
    assert with_resolved_dtype(explicit) is explicit
    remote = dataclasses.replace(ClusterConfig(device="cpu"), ray_address="ray://elsewhere:10001")
    assert with_resolved_dtype(remote).dtype == "auto"  # this machine's CPU says nothing of the remote one


def test_an_explicit_bfloat16_on_a_cpu_without_it_runs_and_says_float32_is_faster(monkeypatch, caplog):
    emulated, native = DtypeProbe(float32_gflops=160, bfloat16_gflops=31), DtypeProbe(200, 470)
    monkeypatch.setattr(dtype_probe, "probe_cpu_matmul", lambda: emulated)
    with caplog.at_level("WARNING", logger="engine.dtype_probe"):
        assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16  # runs: it is correct, only slow
    assert "--dtype float32 (or auto) would run 5.2x faster here" in caplog.text
    caplog.clear()
    monkeypatch.setattr(dtype_probe, "probe_cpu_matmul", lambda: native)
    with caplog.at_level("WARNING", logger="engine.dtype_probe"):
        assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
        assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert caplog.text == ""
