"""DistServe-style placement search: which pools, replica counts and TP degrees give the most goodput per GPU.

DistServe's Algorithm 1, in the simulator's terms. Each TP degree is simulated as a single replica and its
goodput found by bisection over request rates (``bench.slo.find_goodput``), each probe a simulation of
``workload_factory(rate)``:

* prefill alone (TTFT SLO only; every request stops at its first token, so decode is infinitely fast),
* decode alone (TPOT SLO only; the prefill pool is made large enough never to bind),
* colocated (both SLOs), which is the "vLLM++" baseline: the best parallelism for the colocated engine.

A TP degree that uses more GPUs than a smaller one without more goodput is dominated and dropped. Replicas then
scale goodput linearly, as Algorithm 1 assumes: a colocated candidate is ``r`` copies of its instance; a
disaggregated one combines ``m`` prefill and ``n`` decode instances, balanced to maximize min(m * G_prefill,
n * G_decode) per GPU, for every (prefill TP, decode TP) pair that fits ``gpu_budget``. Ranking is by per-GPU
goodput, then by goodput (the bigger of two equally efficient clusters serves more).

Simulating single replicas also keeps probes honest: a probe is a finite workload, and a bigger cluster at a
proportionally higher rate would see it as a shorter burst, never reaching steady state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import yaml

from bench.sim.latency_model import LatencyModel
from bench.sim.simulator import ClusterSpec, SimRequestLike, simulate
from bench.slo import SLO, find_goodput

UNBOUNDED_REPLICAS = 64  # a prefill pool this large never binds while decode is searched alone
WorkloadFactory = Callable[[float], Sequence[SimRequestLike]]
STAGES = ("colocated", "disagg", "prefill-only", "decode-only")


@dataclass(frozen=True)
class Candidate:
    spec: ClusterSpec
    goodput: float  # requests/s at which >= target of requests meet the SLO
    stage: str  # one of STAGES; prefill-only and decode-only are single instances of one pool
    probes: tuple[tuple[float, float], ...] = ()  # (rate, attainment) simulated; empty for replicated instances

    @property
    def num_gpus(self) -> int:
        if self.stage == "prefill-only":
            return self.spec.prefill_tp
        if self.stage == "decode-only":
            return self.spec.decode_tp
        return self.spec.num_gpus

    @property
    def per_gpu_goodput(self) -> float:
        return self.goodput / self.num_gpus


@dataclass(frozen=True)
class PlacementResult:
    best: Candidate
    table: tuple[Candidate, ...]  # whole-cluster candidates within the budget, best first
    instances: tuple[Candidate, ...]  # the simulated single instances they are built from
    slo: SLO
    gpu_budget: int

    def best_of(self, mode: str) -> Candidate | None:
        return next((c for c in self.table if c.spec.mode == mode), None)

    def to_cluster_config(self) -> dict:
        """The best candidate as pdserve cluster-config keys (``cluster.yaml``; ``ClusterConfig.from_dict``)."""
        spec = self.best.spec
        chunk = {} if spec.chunk_size is None else {"max_prefill_chunk": spec.chunk_size}
        if spec.mode == "colocated":
            pool = {"replicas": spec.colocated_replicas, "tensor_parallel_size": spec.colocated_tp}
            pool |= {"max_num_seqs": spec.max_decode_batch, "max_num_batched_tokens": spec.max_batch_tokens}
            return {"mode": "colocated", "colocated": pool | chunk}
        prefill = {"replicas": spec.prefill_replicas, "tensor_parallel_size": spec.prefill_tp}
        prefill |= {"max_num_batched_tokens": spec.max_batch_tokens}
        decode = {"replicas": spec.decode_replicas, "tensor_parallel_size": spec.decode_tp}
        decode |= {"max_num_seqs": spec.max_decode_batch}
        # What the simulator modelled: every prompt on the prefill pool (pdserve serve's default
        # lets decode replicas compute some themselves).
        router = {"conditional_disaggregation": False}
        return {"mode": "disagg", "prefill": prefill | chunk, "decode": decode, "router": router}

    def to_yaml(self) -> str:
        header = (
            f"# pdserve placement search: {self.best.spec.describe()}, goodput {self.best.goodput:.3g} req/s "
            f"({self.best.per_gpu_goodput:.3g} per GPU) at TTFT <= {self.slo.ttft_s} s, "
            f"TPOT <= {self.slo.tpot_s} s within {self.gpu_budget} GPUs\n"
        )
        return header + yaml.safe_dump(self.to_cluster_config(), sort_keys=False)


@dataclass(frozen=True)
class _FirstTokenOnly:
    """A request cut to its first token: prefill alone, with nothing left for decode."""

    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int = 1


class _Evaluator:
    """Goodput of one single-instance spec: bracket the rate by doubling/halving from half the spec's throughput
    ceiling, then bisect with find_goodput.

    Rates never go above the ceiling (``ceiling``: steady-state throughput with full batches of mean requests): no
    queue is stable beyond it, yet a finite probe there is one burst that a big KV cache absorbs whole.
    """

    def __init__(self, latency: LatencyModel, workload_factory: WorkloadFactory, target: float, **sim_kwargs):
        self.latency, self.workload_factory, self.target = latency, workload_factory, target
        self.sim_kwargs = sim_kwargs
        self.tolerance = 0.05
        self.max_probes = 12
        sample = workload_factory(1.0)
        count = max(1, len(sample))
        self.mean_prompt = max(1.0, sum(r.num_prompt_tokens for r in sample) / count)
        self.mean_output = max(1.0, sum(r.num_output_tokens for r in sample) / count)

    def prefill_rate(self, tp: int, max_batch_tokens: int) -> float:
        """Prompts/s one prefill replica sustains with full batches of mean-length prompts."""
        per_step = max(1, int(max_batch_tokens // self.mean_prompt))
        return per_step / self.latency.prefill_time([round(self.mean_prompt)] * per_step, tp)

    def decode_rate(self, tp: int, max_decode_batch: int) -> float:
        """Requests/s one decode replica sustains with its KV cache (or batch limit) full of mean requests."""
        if self.mean_output <= 1:
            return math.inf
        batch = min(max_decode_batch, int(self.latency.max_kv_tokens(tp) // (self.mean_prompt + self.mean_output)))
        if batch < 1:
            return 0.0
        context = round(batch * (self.mean_prompt + self.mean_output / 2))
        return batch / ((self.mean_output - 1) * self.latency.decode_step_time(batch, context, tp))

    def ceiling(self, spec: ClusterSpec, stage: str) -> float:
        if stage == "colocated":
            prefill = self.prefill_rate(spec.colocated_tp, spec.max_batch_tokens)
            decode = self.decode_rate(spec.colocated_tp, spec.max_decode_batch)
            return 1 / (1 / prefill + 1 / decode)  # one replica time-shares both phases
        if stage == "prefill-only":
            return self.prefill_rate(spec.prefill_tp, spec.max_batch_tokens)
        return self.decode_rate(spec.decode_tp, spec.max_decode_batch)

    def requests(self, rate: float, stage: str) -> Sequence[SimRequestLike]:
        requests = self.workload_factory(rate)
        if stage == "prefill-only":
            return [_FirstTokenOnly(r.arrival_s, r.num_prompt_tokens) for r in requests]
        return requests

    def goodput(self, spec: ClusterSpec, slo: SLO, stage: str) -> Candidate:
        cache: dict[float, float] = {}

        def attainment_at(rate: float) -> float:
            if rate not in cache:
                result = simulate(spec, self.requests(rate, stage), self.latency, **self.sim_kwargs)
                cache[rate] = result.attainment(slo)
            return cache[rate]

        ceiling = self.ceiling(spec, stage)
        if not 0 < ceiling < math.inf:
            return Candidate(spec, 0.0, stage)
        low = high = ceiling / 2
        if attainment_at(low) >= self.target:
            while high < ceiling:
                high = min(2 * high, ceiling)
                if attainment_at(high) < self.target:
                    break
                low = high
        else:
            for _ in range(10):
                low /= 2
                if attainment_at(low) >= self.target:
                    break
                high = low
        if attainment_at(low) < self.target:
            good = 0.0
        elif attainment_at(high) >= self.target:
            good = high
        else:
            good, _ = find_goodput(attainment_at, low, high, self.target, self.tolerance, self.max_probes)
        return Candidate(spec, good, stage, tuple(sorted(cache.items())))


def search_placement(
    model_latency: LatencyModel | Callable[[], LatencyModel],
    workload_factory: WorkloadFactory,
    slo: SLO,
    gpu_budget: int,
    tp_options: Sequence[int] = (1, 2, 4, 8),
    max_replicas: int = 8,
    target: float = 0.9,
    kv_link_bandwidth: float = 25e9,
    kv_overlap: float = 0.9,
    modes: Sequence[str] = ("colocated", "disagg"),
    base_spec: ClusterSpec | None = None,
) -> PlacementResult:
    """Best placement within ``gpu_budget`` GPUs by goodput per GPU, with every candidate and instance behind it.

    ``workload_factory(rate)`` returns one probe's requests at ``rate`` req/s; a few hundred keep the search to
    seconds (each is simulated on one replica). ``base_spec`` carries the scheduler settings (batch budgets,
    chunk size) every candidate shares.
    """
    if gpu_budget < 1:
        raise ValueError(f"gpu_budget={gpu_budget} must be >= 1")
    if not isinstance(model_latency, LatencyModel):
        model_latency = model_latency()
    latency = model_latency
    base = base_spec or ClusterSpec()
    tps = sorted(tp for tp in set(tp_options) if tp <= gpu_budget and latency.supports_tp(tp))
    if not tps:
        raise ValueError(f"no TP degree of {tuple(tp_options)} fits {gpu_budget} GPUs and the model; widen tp_options")
    sim_kwargs = {"kv_link_bandwidth": kv_link_bandwidth, "kv_overlap": kv_overlap}
    evaluator = _Evaluator(latency, workload_factory, target, **sim_kwargs)
    instances: list[Candidate] = []
    table: list[Candidate] = []
    if "colocated" in modes:
        colocated = [evaluator.goodput(_instance(base, "colocated", tp, tps[0]), slo, "colocated") for tp in tps]
        instances += colocated
        for single in _undominated(colocated):
            replicas = min(max_replicas, gpu_budget // single.num_gpus)
            spec = replace(single.spec, colocated_replicas=replicas)
            table.append(Candidate(spec, replicas * single.goodput, "colocated"))
    if "disagg" in modes and gpu_budget >= 2:
        prefill_slo, decode_slo = SLO(slo.ttft_s, math.inf), SLO(math.inf, slo.tpot_s)
        prefill = [
            evaluator.goodput(_instance(base, "prefill-only", tp, tps[0]), prefill_slo, "prefill-only") for tp in tps
        ]
        decode = [
            evaluator.goodput(_instance(base, "decode-only", tp, tps[0]), decode_slo, "decode-only") for tp in tps
        ]
        instances += prefill + decode
        table += _combine(_undominated(prefill), _undominated(decode), gpu_budget, max_replicas)
    if not table:
        raise ValueError(f"no candidate of modes {tuple(modes)} meets the SLO within {gpu_budget} GPUs")
    table.sort(key=lambda c: (-c.per_gpu_goodput, -c.goodput, c.spec.describe()))
    return PlacementResult(table[0], tuple(table), tuple(instances), slo, gpu_budget)


def _instance(base: ClusterSpec, stage: str, tp: int, smallest_tp: int) -> ClusterSpec:
    if stage == "colocated":
        return replace(base, mode="colocated", colocated_replicas=1, colocated_tp=tp)
    if stage == "prefill-only":
        return replace(base, mode="disagg", prefill_replicas=1, prefill_tp=tp, decode_replicas=1, decode_tp=tp)
    return replace(
        base,
        mode="disagg",
        prefill_replicas=UNBOUNDED_REPLICAS,
        prefill_tp=smallest_tp,
        decode_replicas=1,
        decode_tp=tp,
    )


def _undominated(instances: list[Candidate]) -> list[Candidate]:
    """Instances with goodput that no instance on as few GPUs matches (more GPUs must buy more goodput)."""
    return [
        c
        for c in instances
        if c.goodput > 0
        and not any(o is not c and o.num_gpus <= c.num_gpus and o.goodput >= c.goodput for o in instances)
    ]


def _combine(prefill: list[Candidate], decode: list[Candidate], budget: int, max_replicas: int) -> list[Candidate]:
    """For each (prefill TP, decode TP): the replica counts with the most goodput per GPU within the budget."""
    combined = []
    for p in prefill:
        for d in decode:
            best: tuple[float, float, int, int] | None = None
            for m in range(1, max_replicas + 1):
                for n in range(1, max_replicas + 1):
                    gpus = m * p.num_gpus + n * d.num_gpus
                    if gpus > budget:
                        continue
                    rate = min(m * p.goodput, n * d.goodput)
                    key = (rate / gpus, rate, m, n)
                    if best is None or key[:2] > best[:2]:
                        best = key
            if best is not None:
                _, rate, m, n = best
                spec = replace(p.spec, prefill_replicas=m, decode_replicas=n, decode_tp=d.spec.decode_tp)
                combined.append(Candidate(spec, rate, "disagg"))
    return combined
