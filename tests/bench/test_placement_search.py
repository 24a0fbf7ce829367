"""DistServe-style placement search on the analytic OPT-13B / A100 model and a synthetic chatbot workload."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest
import yaml

from bench.sim.hardware import get_hardware
from bench.sim.latency_model import AnalyticModel, DecodeFit, PrefillFit, ProfiledModel, TPProfile
from bench.sim.models import get_model
from bench.sim.placement import search_placement
from bench.slo import SLO

OPT_A100 = AnalyticModel(get_model("opt-13b"), get_hardware("A100-80GB"))
CHATBOT_SLO = SLO(ttft_s=0.25, tpot_s=0.1)  # DistServe's chatbot SLOs for OPT-13B
NUM_REQUESTS = 1000  # per probe: enough for a single replica's decode batch to reach steady state


@dataclass(frozen=True)
class Req:
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int


def chatbot(rate: float) -> list[Req]:
    """ShareGPT-like: lognormal prompts (mean ~700 before clipping to OPT's context) and outputs (mean ~200),
    Poisson arrivals. The same seed at every rate, so rates differ only in spacing."""
    rng = np.random.default_rng(0)
    sigma = 0.8
    prompts = rng.lognormal(math.log(700) - sigma**2 / 2, sigma, NUM_REQUESTS).clip(4, 1536).astype(int)
    outputs = rng.lognormal(math.log(200) - sigma**2 / 2, sigma, NUM_REQUESTS).clip(2, 512).astype(int)
    arrivals = np.cumsum(rng.exponential(1.0, NUM_REQUESTS)) / rate
    return [Req(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs, strict=True)]


@cache
def full_search(gpu_budget: int):
    return search_placement(OPT_A100, chatbot, CHATBOT_SLO, gpu_budget=gpu_budget)


def test_search_returns_a_valid_config_within_the_budget():
    result = full_search(4)
    assert result.best is result.table[0]
    assert all(c.num_gpus <= 4 for c in result.table)
    assert result.best.goodput > 0
    assert [c.per_gpu_goodput for c in result.table] == sorted((c.per_gpu_goodput for c in result.table), reverse=True)
    config = result.to_cluster_config()
    mode = config["mode"]
    pools = ["prefill", "decode"] if mode == "disagg" else ["colocated"]
    # Disaggregated as simulated: every prompt on the prefill pool (not pdserve serve's default).
    assert set(config) == {"mode", *pools} | ({"router"} if mode == "disagg" else set())
    gpus = sum(config[p]["replicas"] * config[p]["tensor_parallel_size"] for p in pools)
    assert gpus == result.best.num_gpus <= 4
    assert yaml.safe_load(result.to_yaml()) == config


def test_every_candidate_becomes_a_config_pdserve_accepts():
    from cluster.cluster_config import ClusterConfig  # tests may cross the layering; bench itself never does

    result = full_search(4)
    for mode in ("disagg", "colocated"):
        best = result.best_of(mode)
        assert best is not None
        config = type(result)(best, result.table, result.instances, result.slo, 4).to_cluster_config()
        parsed = ClusterConfig.from_dict(config)
        assert parsed.mode == mode
        assert parsed.router.conditional_disaggregation is (mode == "colocated")  # unused there
        assert sum(parsed.pool(p).replicas * parsed.pool(p).tensor_parallel_size for p in parsed.pools()) <= 4


def test_disagg_beats_the_colocated_baseline_distserve_compares_with():
    """DistServe §6.2 compares with vLLM at its parallelism for OPT-13B, TP=1. Searched disaggregation must beat it
    per GPU on the chatbot workload (DistServe reports 2.0-4.6x there; this model gives ~2.7x on 4 GPUs)."""
    disagg = full_search(4).best_of("disagg")
    vllm = search_placement(OPT_A100, chatbot, CHATBOT_SLO, gpu_budget=4, tp_options=(1,), modes=("colocated",)).best
    assert vllm.spec.colocated_tp == 1 and vllm.num_gpus == 4
    ratio = disagg.per_gpu_goodput / vllm.per_gpu_goodput
    assert ratio > 1, f"disagg {disagg.spec.describe()} / colocated TP1: per-GPU goodput ratio {ratio:.2f}"


def test_the_search_follows_distserve_algorithm_1():
    """Phases searched alone on single instances, then balanced: the disaggregated table entries are built from
    undominated prefill-only and decode-only instances, replicated linearly."""
    result = full_search(4)
    instances = {(c.stage, c.num_gpus): c for c in result.instances}
    assert {stage for stage, _ in instances} == {"colocated", "prefill-only", "decode-only"}
    assert all(c.probes for c in result.instances)  # each instance was simulated
    for candidate in (c for c in result.table if c.spec.mode == "disagg"):
        prefill = instances["prefill-only", candidate.spec.prefill_tp].goodput
        decode = instances["decode-only", candidate.spec.decode_tp].goodput
        expected = min(candidate.spec.prefill_replicas * prefill, candidate.spec.decode_replicas * decode)
        assert candidate.goodput == pytest.approx(expected)
    # TTFT 0.25 s at TP=1 leaves long prompts no room: one GPU prefills far less per GPU than two do.
    assert instances["prefill-only", 1].per_gpu_goodput < instances["prefill-only", 2].per_gpu_goodput


def test_search_uses_only_the_tp_degrees_a_profile_has():
    profile = TPProfile(PrefillFit(0.005, 2e-5, 0.0), DecodeFit(0.01, 1e-4, 1e-8), 20000)
    model = ProfiledModel(kv_bytes_per_token=1000, per_tp={1: profile})
    result = search_placement(model, chatbot, SLO(1.0, 0.05), gpu_budget=3, tp_options=(1, 2, 4))
    assert {c.num_gpus for c in result.instances} == {1}
    assert result.best.num_gpus <= 3 and result.best.goodput > 0
    with pytest.raises(ValueError, match="no TP degree"):
        search_placement(model, chatbot, SLO(1.0, 0.05), gpu_budget=3, tp_options=(2, 4))
    with pytest.raises(ValueError, match="gpu_budget=0"):
        search_placement(model, chatbot, SLO(1.0, 0.05), gpu_budget=0)


def test_pdserve_plan_writes_a_config_that_pdserve_serve_loads(tmp_path):
    from cluster.cli import main
    from cluster.cluster_config import load_cluster_config

    out = tmp_path / "plan.yaml"
    assert (
        main(["plan", "--model", "opt-13b", "--gpus", "4", "--tp", "1,2", "--num-requests", "60", "--out", str(out)])
        == 0
    )
    config = load_cluster_config(out)  # what `pdserve serve --config` reads
    assert config.num_shards <= 4 and config.mode in ("disagg", "colocated")
