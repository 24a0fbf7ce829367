"""The discrete-event simulator: conservation, KV capacity, determinism, exact single-request timings, and the
prefill-decode interference that colocation has and disaggregation removes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from bench.sim.hardware import get_hardware
from bench.sim.latency_model import AnalyticModel, DecodeFit, PrefillFit, ProfiledModel, TPProfile
from bench.sim.models import get_model
from bench.sim.simulator import ClusterSpec, simulate
from bench.slo import SLO

OPT_A100 = AnalyticModel(get_model("opt-13b"), get_hardware("A100-80GB"))
LINK = 25e9


@dataclass(frozen=True)
class Req:
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int


def tight_model(capacity: int) -> ProfiledModel:
    """A small, fast model whose replicas hold only ``capacity`` KV tokens."""
    profile = TPProfile(PrefillFit(0.002, 1e-5, 1e-9), DecodeFit(0.01, 1e-4, 1e-7), capacity)
    return ProfiledModel(kv_bytes_per_token=1000, per_tp={1: profile})


def workload(n: int, rate: float, seed: int = 0, max_prompt: int = 2000) -> list[Req]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    prompts = rng.integers(16, max_prompt, n)
    outputs = rng.integers(1, 300, n)
    return [Req(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs, strict=True)]


SPECS = [
    ClusterSpec(mode="disagg", prefill_replicas=2, decode_replicas=2),
    ClusterSpec(mode="disagg", prefill_replicas=1, decode_replicas=3, chunk_size=512),
    ClusterSpec(mode="colocated", colocated_replicas=3),
    ClusterSpec(mode="colocated", colocated_replicas=2, chunk_size=256, max_batch_tokens=512),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe() + (f" chunk {s.chunk_size}" if s.chunk_size else ""))
def test_every_request_ends_exactly_once(spec):
    requests = workload(300, rate=4.0)
    result = simulate(spec, requests, OPT_A100, LINK)
    assert len(result.timings) == len(requests)
    assert result.num_completed == len(requests) and result.num_failed == 0
    for req, timing in zip(requests, result.timings, strict=True):
        assert timing.succeeded and timing.num_output_tokens == req.num_output_tokens
        assert 0 < timing.ttft_s <= timing.e2e_s
        assert (timing.tpot_s is None) == (req.num_output_tokens == 1)
    assert result.makespan_s >= max(r.arrival_s for r in requests)
    assert result.num_prefill_steps > 0 and result.num_decode_steps > 0


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_kv_capacity_is_never_exceeded_and_oversized_requests_fail(mode):
    capacity = 1000
    requests = workload(200, rate=50.0, seed=3, max_prompt=600)  # many at once, each needs up to ~900 tokens
    requests.append(Req(0.5, 900, 200))  # can never fit: fails, the rest carry on
    spec = ClusterSpec(mode=mode, prefill_replicas=1, decode_replicas=2, colocated_replicas=2)
    result = simulate(spec, requests, tight_model(capacity), LINK)
    assert result.kv_capacity_tokens == capacity
    assert len(result.max_kv_tokens_used_per_replica) == 2
    assert all(capacity - 300 < peak <= capacity for peak in result.max_kv_tokens_used_per_replica)  # it binds
    assert result.num_failed == 1 and not result.timings[-1].succeeded and result.timings[-1].ttft_s is None
    assert result.num_completed == len(requests) - 1
    assert result.attainment(SLO(1e9, 1e9)) == pytest.approx((len(requests) - 1) / len(requests))


def test_same_inputs_same_result():
    requests = workload(200, rate=6.0, seed=7)
    for spec in SPECS:
        assert simulate(spec, requests, OPT_A100, LINK) == simulate(spec, requests, OPT_A100, LINK)


@pytest.mark.parametrize("kv_overlap", [0.0, 0.9, 1.0])
def test_single_request_disagg_timings_are_the_model_step_times(kv_overlap):
    prompt, output, tp = 700, 50, 2
    spec = ClusterSpec(mode="disagg", prefill_tp=tp, decode_tp=tp)
    result = simulate(spec, [Req(1.25, prompt, output)], OPT_A100, LINK, kv_overlap=kv_overlap)
    timing = result.timings[0]
    assert timing.ttft_s == pytest.approx(OPT_A100.prefill_time([prompt], tp), rel=1e-9)
    exposed = (1 - kv_overlap) * OPT_A100.kv_bytes(prompt) / LINK
    decode = sum(OPT_A100.decode_step_time(1, prompt + generated, tp) for generated in range(1, output))
    assert timing.tpot_s == pytest.approx((exposed + decode) / (output - 1), rel=1e-9)
    assert result.num_decode_steps == output - 1 and result.kv_transfer_bytes == OPT_A100.kv_bytes(prompt)


def test_single_request_colocated_timings_are_the_model_step_times():
    prompt, output = 300, 20
    timing = simulate(ClusterSpec(mode="colocated"), [Req(0.0, prompt, output)], OPT_A100, LINK).timings[0]
    assert timing.ttft_s == OPT_A100.prefill_time([prompt], 1)
    decode = sum(OPT_A100.decode_step_time(1, prompt + generated, 1) for generated in range(1, output))
    assert timing.tpot_s == pytest.approx(decode / (output - 1), rel=1e-9)


def test_prefill_batches_whole_prompts_up_to_the_token_budget():
    requests = [Req(0.0, 800, 1), Req(0.0, 800, 1), Req(0.0, 800, 1)]
    result = simulate(ClusterSpec(mode="disagg", max_batch_tokens=2048), requests, OPT_A100, LINK)
    first_step = OPT_A100.prefill_time([800, 800], 1)
    assert result.num_prefill_steps == 2
    assert [t.ttft_s for t in result.timings] == [first_step, first_step, first_step + OPT_A100.prefill_time([800], 1)]


def test_a_prompt_longer_than_the_budget_runs_alone_or_in_chunks():
    whole = simulate(ClusterSpec(max_batch_tokens=1024), [Req(0.0, 3000, 1)], OPT_A100, LINK)
    assert whole.num_prefill_steps == 1 and whole.timings[0].ttft_s == OPT_A100.prefill_time([3000], 1)
    chunked = simulate(ClusterSpec(max_batch_tokens=1024, chunk_size=1024), [Req(0.0, 3000, 1)], OPT_A100, LINK)
    steps = [OPT_A100.prefill_time([n], 1, [done]) for n, done in ((1024, 0), (1024, 1024), (952, 2048))]
    assert chunked.num_prefill_steps == 3 and chunked.timings[0].ttft_s == pytest.approx(sum(steps), rel=1e-9)


def test_decode_batch_limit_serializes_requests():
    requests = [Req(0.0, 100, 11), Req(0.0, 100, 21)]
    limited = simulate(ClusterSpec(max_decode_batch=1), requests, OPT_A100, LINK)
    batched = simulate(ClusterSpec(max_decode_batch=256), requests, OPT_A100, LINK)
    assert limited.num_decode_steps == 10 + 20 and batched.num_decode_steps == 20


def _victim_tpot(mode: str, with_intruder: bool) -> float:
    victim = Req(0.0, 500, 60)
    intruder = Req(0.3, 2000, 10)  # arrives while the victim decodes
    requests = [victim, intruder] if with_intruder else [victim]
    result = simulate(ClusterSpec(mode=mode), requests, OPT_A100, LINK)
    return result.timings[0].tpot_s


def test_colocated_prefill_stalls_running_decodes_and_disagg_does_not():
    colocated = _victim_tpot("colocated", True) / _victim_tpot("colocated", False)
    disagg = _victim_tpot("disagg", True) / _victim_tpot("disagg", False)
    assert colocated > 1.25  # the 2000-token prefill (~0.33 s) pauses the victim's ~18 ms steps
    assert disagg < 1.05  # the intruder only joins the decode batch: a little more KV to read per step


def test_cluster_spec_validates_and_counts_gpus():
    assert ClusterSpec(mode="disagg", prefill_replicas=2, prefill_tp=2, decode_replicas=3, decode_tp=1).num_gpus == 7
    assert ClusterSpec(mode="colocated", colocated_replicas=2, colocated_tp=4).num_gpus == 8
    with pytest.raises(ValueError, match="mode='split'"):
        ClusterSpec(mode="split")
    with pytest.raises(ValueError, match="decode_replicas=0"):
        ClusterSpec(decode_replicas=0)
    with pytest.raises(ValueError, match="chunk_size=0"):
        ClusterSpec(chunk_size=0)
    with pytest.raises(ValueError, match="kv_overlap"):
        simulate(ClusterSpec(), [], OPT_A100, LINK, kv_overlap=1.5)
