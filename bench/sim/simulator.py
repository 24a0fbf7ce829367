"""A discrete-event simulation of a pdserve cluster: requests in, one ``RequestTiming`` each out, no wall clock.

Disaggregated, a request walks these states (``State``):

    WAITING      queued on the least-loaded prefill replica (fewest prompt tokens still to prefill)
    PREFILLING   in a prefill step (FCFS batches up to ``max_batch_tokens``; chunks when ``chunk_size`` is set);
                 its first token exists when the step that finishes its prompt ends: TTFT stops there
    KV_QUEUED    queued on the least-loaded decode replica (fewest KV tokens held or owed) until its prompt +
                 output tokens fit that replica's KV capacity (FCFS, reserved in full, so it never overflows)
    TRANSFERRING its KV crosses the link; layer-pipelining hides ``kv_overlap`` of the transfer behind prefill
    RUNNING      in the decode replica's continuous batch: every step emits one token for every running request
    FINISHED     after its last token; its reservation is released and queued requests are admitted

Colocated (vLLM-like iteration-level scheduling), a replica runs one step at a time: a prefill step whenever a
waiting request fits (prefill first, as vLLM's default scheduler does), else a decode step of everything running,
so every prefill stalls the running decodes -- the interference DistServe removes. With ``chunk_size`` a step
instead carries all running decodes plus prefill chunks up to the token budget (Sarathi-style).

A request whose prompt + output can never fit a replica's KV cache ends FAILED at arrival (succeeded=False).

Simplifications, the same for both modes: KV is reserved in full at admission (no
preemption); transfers do not contend for the link; prefill replicas are not short of KV (their capacity only
bounds the longest prompt).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from bench.sim.latency_model import LatencyModel
from bench.slo import SLO, RequestTiming, attainment

MODES = ("colocated", "disagg")


class SimRequestLike(Protocol):
    """What the simulator reads of a request (``bench.workloads.WorkloadRequest`` has these and more)."""

    @property
    def arrival_s(self) -> float: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...


@dataclass(frozen=True)
class ClusterSpec:
    mode: str = "disagg"
    prefill_replicas: int = 1
    prefill_tp: int = 1
    decode_replicas: int = 1
    decode_tp: int = 1
    colocated_replicas: int = 1
    colocated_tp: int = 1
    max_batch_tokens: int = 2048  # prefill token budget of one step
    max_decode_batch: int = 256  # most sequences in one decode batch
    chunk_size: int | None = None  # chunked prefill: most tokens of one prompt per step; None = whole prompts

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not supported; use one of {', '.join(MODES)}")
        counts = (
            "prefill_replicas",
            "prefill_tp",
            "decode_replicas",
            "decode_tp",
            "colocated_replicas",
            "colocated_tp",
        )
        for key in (*counts, "max_batch_tokens", "max_decode_batch"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size} must be >= 1, or None for whole prompts")

    @property
    def num_gpus(self) -> int:
        if self.mode == "disagg":
            return self.prefill_replicas * self.prefill_tp + self.decode_replicas * self.decode_tp
        return self.colocated_replicas * self.colocated_tp

    def describe(self) -> str:
        if self.mode == "disagg":
            return f"disagg P{self.prefill_replicas}xTP{self.prefill_tp} + D{self.decode_replicas}xTP{self.decode_tp}"
        return f"colocated {self.colocated_replicas}xTP{self.colocated_tp}"


@dataclass(frozen=True)
class SimResult:
    timings: list[RequestTiming]  # one per request, in input order
    num_completed: int
    num_failed: int
    num_prefill_steps: int  # steps that ran prefill (colocated chunked steps with chunks count here)
    num_decode_steps: int
    kv_transfer_bytes: int
    makespan_s: float  # last event time
    kv_capacity_tokens: int  # per replica of the pool that holds running KV (decode, or colocated)
    max_kv_tokens_used_per_replica: tuple[int, ...]  # peak reserved KV tokens of each of those replicas

    def attainment(self, slo: SLO) -> float:
        return attainment(self.timings, slo)


class State(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    KV_QUEUED = "kv_queued"
    TRANSFERRING = "transferring"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(slots=True)
class _Request:
    index: int
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    state: State = State.WAITING
    num_computed: int = 0  # prompt tokens whose KV exists
    num_generated: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def kv_need(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def context(self) -> int:
        return self.num_prompt_tokens + self.num_generated


@dataclass(slots=True)
class _Replica:
    """One replica of any pool; prefill replicas leave the decode-side fields empty."""

    index: int
    tp: int
    kv_capacity: int
    waiting: deque[_Request] = field(default_factory=deque)  # prefill queue, or (decode) KV_QUEUED
    ready: deque[_Request] = field(default_factory=deque)  # decode: KV arrived, not yet batched
    running: list[tuple[int, int, _Request]] = field(default_factory=list)  # heap of (finish step, index, request)
    batch: list[tuple[_Request, int]] = field(default_factory=list)  # prefill (request, tokens) of this step
    busy: bool = False
    load_tokens: int = 0  # routing key: prompt tokens to prefill (prefill pool); KV tokens held or owed (others)
    reserved_tokens: int = 0
    peak_reserved_tokens: int = 0
    context_tokens: int = 0  # sum of running requests' contexts
    num_decode_steps: int = 0

    def reserve(self, req: _Request) -> None:
        self.reserved_tokens += req.kv_need
        assert self.reserved_tokens <= self.kv_capacity, f"replica {self.index} KV over capacity"
        self.peak_reserved_tokens = max(self.peak_reserved_tokens, self.reserved_tokens)

    def fits(self, req: _Request) -> bool:
        return self.reserved_tokens + req.kv_need <= self.kv_capacity

    def join(self, req: _Request) -> None:
        """Into the decode batch. A request's last step is known when it joins, so a step costs O(finished), not
        O(running): ``num_generated`` is brought up to date only when the request leaves."""
        req.state = State.RUNNING
        finish_step = self.num_decode_steps + req.num_output_tokens - req.num_generated
        heapq.heappush(self.running, (finish_step, req.index, req))
        self.context_tokens += req.context

    def advance(self) -> list[_Request]:
        """One decode step ended: every running request emitted a token. Returns those that emitted their last."""
        self.num_decode_steps += 1
        self.context_tokens += len(self.running)
        finished = []
        while self.running and self.running[0][0] <= self.num_decode_steps:
            req = heapq.heappop(self.running)[2]
            req.num_generated = req.num_output_tokens
            self.context_tokens -= req.context
            finished.append(req)
        return finished


def _take_prefill(replica: _Replica, budget: int, chunk_size: int | None, admit: Callable[[_Request], bool]) -> None:
    """FCFS prefill batch into ``replica.batch``: whole prompts while they fit ``budget`` (the first always goes,
    alone if it is longer), or chunks of at most ``chunk_size``. ``admit`` may refuse a request that has not
    started (no KV room), which ends the batch: later requests never overtake it."""
    for req in replica.waiting:
        remaining = req.num_prompt_tokens - req.num_computed
        if chunk_size is None:
            if replica.batch and remaining > budget:
                break
            take = remaining
        else:
            take = min(remaining, chunk_size, budget)
            if take <= 0:
                break
        if req.state is State.WAITING and not admit(req):
            break
        req.state = State.PREFILLING
        replica.batch.append((req, take))
        budget -= take


class _Simulation:
    def __init__(self, spec: ClusterSpec, latency: LatencyModel, kv_link_bandwidth: float, kv_overlap: float):
        self.spec, self.latency = spec, latency
        self.kv_link_bandwidth, self.kv_overlap = kv_link_bandwidth, kv_overlap
        self.events: list[tuple[float, int, Callable[..., None], object]] = []
        self.seq = 0
        self.now = 0.0
        self.num_prefill_steps = self.num_decode_steps = self.kv_transfer_bytes = 0
        if spec.mode == "disagg":
            prefill_capacity = latency.max_kv_tokens(spec.prefill_tp)
            self.prefill = [_Replica(i, spec.prefill_tp, prefill_capacity) for i in range(spec.prefill_replicas)]
            capacity = latency.max_kv_tokens(spec.decode_tp)
            self.kv_pool = [_Replica(i, spec.decode_tp, capacity) for i in range(spec.decode_replicas)]
            self.prompt_capacity = min(prefill_capacity, capacity)
        else:
            capacity = latency.max_kv_tokens(spec.colocated_tp)
            self.kv_pool = [_Replica(i, spec.colocated_tp, capacity) for i in range(spec.colocated_replicas)]
            self.prompt_capacity = capacity
        self.kv_capacity = capacity

    def at(self, time: float, handler: Callable[..., None], target: object) -> None:
        self.seq += 1  # ties break by scheduling order: the run is deterministic
        heapq.heappush(self.events, (time, self.seq, handler, target))

    def run(self, requests: list[_Request]) -> None:
        for req in requests:
            self.at(req.arrival_s, self.on_arrival, req)
        while self.events:
            self.now, _, handler, target = heapq.heappop(self.events)
            handler(target)

    # -- arrival and routing ------------------------------------------------------------------------------------
    def on_arrival(self, req: _Request) -> None:
        if req.kv_need > self.kv_capacity or req.num_prompt_tokens > self.prompt_capacity:
            req.state, req.finish_s = State.FAILED, self.now
            return
        if self.spec.mode == "colocated":
            replica = min(self.kv_pool, key=lambda r: (r.load_tokens, r.index))
            replica.load_tokens += req.kv_need
            replica.waiting.append(req)
            self.at(self.now, self.start_colocated_step, replica)  # after every arrival of this instant
            return
        replica = min(self.prefill, key=lambda r: (r.load_tokens, r.index))
        replica.load_tokens += req.num_prompt_tokens
        replica.waiting.append(req)
        self.at(self.now, self.start_prefill_step, replica)  # after every arrival of this instant: one batch

    def finish(self, req: _Request, replica: _Replica | None) -> None:
        req.state, req.finish_s = State.FINISHED, self.now
        if replica is not None:
            replica.reserved_tokens -= req.kv_need
            replica.load_tokens -= req.kv_need

    def first_token(self, req: _Request) -> None:
        req.first_token_s, req.num_generated = self.now, 1

    # -- disaggregated prefill ---------------------------------------------------------------------------------
    def start_prefill_step(self, replica: _Replica) -> None:
        if replica.busy or not replica.waiting:
            return
        _take_prefill(replica, self.spec.max_batch_tokens, self.spec.chunk_size, lambda req: True)
        tokens = [take for _, take in replica.batch]
        computed = [req.num_computed for req, _ in replica.batch]
        replica.busy = True
        self.num_prefill_steps += 1
        self.at(self.now + self.latency.prefill_time(tokens, replica.tp, computed), self.on_prefill_done, replica)

    def on_prefill_done(self, replica: _Replica) -> None:
        for req, take in replica.batch:
            req.num_computed += take
            replica.load_tokens -= take
            if req.num_computed == req.num_prompt_tokens:
                self.first_token(req)
                if req.num_generated >= req.num_output_tokens:
                    self.finish(req, None)
                else:
                    self.route_to_decode(req)
        replica.waiting = deque(req for req in replica.waiting if req.num_computed < req.num_prompt_tokens)
        replica.batch, replica.busy = [], False
        self.start_prefill_step(replica)

    # -- disaggregated decode ----------------------------------------------------------------------------------
    def route_to_decode(self, req: _Request) -> None:
        replica = min(self.kv_pool, key=lambda r: (r.load_tokens, r.index))
        replica.load_tokens += req.kv_need
        req.state = State.KV_QUEUED
        replica.waiting.append(req)
        self.admit_to_decode(replica)

    def admit_to_decode(self, replica: _Replica) -> None:
        while replica.waiting and replica.fits(replica.waiting[0]):
            req = replica.waiting.popleft()
            replica.reserve(req)
            req.state = State.TRANSFERRING
            num_bytes = self.latency.kv_bytes(req.num_prompt_tokens)
            self.kv_transfer_bytes += num_bytes
            exposed = (1.0 - self.kv_overlap) * num_bytes / self.kv_link_bandwidth
            self.at(self.now + exposed, self.on_kv_arrived, (replica, req))

    def on_kv_arrived(self, target: tuple[_Replica, _Request]) -> None:
        replica, req = target
        replica.ready.append(req)  # joins the batch when the step in flight ends
        self.at(self.now, self.start_decode_step, replica)

    def start_decode_step(self, replica: _Replica) -> None:
        if replica.busy:
            return
        while replica.ready and len(replica.running) < self.spec.max_decode_batch:
            replica.join(replica.ready.popleft())
        if not replica.running:
            return
        replica.busy = True
        self.num_decode_steps += 1
        step = self.latency.decode_step_time(len(replica.running), replica.context_tokens, replica.tp)
        self.at(self.now + step, self.on_decode_done, replica)

    def advance_decodes(self, replica: _Replica) -> None:
        for req in replica.advance():
            self.finish(req, replica)  # frees its KV for the queued

    def on_decode_done(self, replica: _Replica) -> None:
        self.advance_decodes(replica)
        replica.busy = False
        self.admit_to_decode(replica)
        self.start_decode_step(replica)

    # -- colocated ---------------------------------------------------------------------------------------------
    def start_colocated_step(self, replica: _Replica) -> None:
        if replica.busy:
            return
        spec = self.spec
        num_admitted = len(replica.running)

        def admit(req: _Request) -> bool:
            nonlocal num_admitted
            if not replica.fits(req) or num_admitted >= spec.max_decode_batch:
                return False
            replica.reserve(req)
            num_admitted += 1
            return True

        if spec.chunk_size is None:
            _take_prefill(replica, spec.max_batch_tokens, None, admit)
            decodes = 0 if replica.batch else len(replica.running)  # prefill first: running decodes stall
        else:
            budget = spec.max_batch_tokens - len(replica.running)  # decodes take one token of the budget each
            if budget > 0:
                _take_prefill(replica, budget, spec.chunk_size, admit)
            decodes = len(replica.running)
        if not replica.batch and not decodes:
            return
        tokens = [take for _, take in replica.batch]
        computed = [req.num_computed for req, _ in replica.batch]
        context = replica.context_tokens if decodes else 0
        if tokens and decodes:
            step = self.latency.mixed_step_time(tokens, computed, decodes, context, replica.tp)
        elif tokens:
            step = self.latency.prefill_time(tokens, replica.tp, computed)
        else:
            step = self.latency.decode_step_time(decodes, context, replica.tp)
        self.num_prefill_steps += bool(tokens)
        self.num_decode_steps += bool(decodes)
        replica.busy = True
        self.at(self.now + step, self.on_colocated_done, (replica, bool(decodes)))

    def on_colocated_done(self, target: tuple[_Replica, bool]) -> None:
        replica, decoded = target
        if decoded:
            self.advance_decodes(replica)
        for req, take in replica.batch:
            req.num_computed += take
            if req.num_computed == req.num_prompt_tokens:
                self.first_token(req)
                if req.num_generated >= req.num_output_tokens:
                    self.finish(req, replica)
                else:
                    replica.join(req)
        replica.waiting = deque(req for req in replica.waiting if req.num_computed < req.num_prompt_tokens)
        replica.batch, replica.busy = [], False
        self.start_colocated_step(replica)


def _timing(req: _Request) -> RequestTiming:
    if req.state is State.FAILED:
        return RequestTiming(None, None, None, req.num_output_tokens, succeeded=False)
    assert req.state is State.FINISHED and req.first_token_s is not None and req.finish_s is not None, req
    tpot = None
    if req.num_output_tokens > 1:
        tpot = (req.finish_s - req.first_token_s) / (req.num_output_tokens - 1)
    return RequestTiming(req.first_token_s - req.arrival_s, tpot, req.finish_s - req.arrival_s, req.num_output_tokens)


def simulate(
    spec: ClusterSpec,
    requests: Sequence[SimRequestLike],
    latency: LatencyModel,
    kv_link_bandwidth: float = 25e9,
    kv_overlap: float = 0.9,
) -> SimResult:
    """Run ``requests`` through ``spec`` with step times from ``latency``; deterministic for the same inputs.

    ``kv_link_bandwidth`` (bytes/s) carries each prompt's KV from prefill to decode (disagg only); ``kv_overlap``
    is the share of that transfer hidden behind the prefill computation by layer-by-layer pipelining.
    """
    if not kv_link_bandwidth > 0:
        raise ValueError(f"kv_link_bandwidth={kv_link_bandwidth} must be > 0 bytes/s")
    if not 0.0 <= kv_overlap <= 1.0:
        raise ValueError(f"kv_overlap={kv_overlap} must be in [0, 1]")
    reqs = [
        _Request(i, float(r.arrival_s), int(r.num_prompt_tokens), max(1, int(r.num_output_tokens)))
        for i, r in enumerate(requests)
    ]
    for req in reqs:
        if req.num_prompt_tokens < 1:
            raise ValueError(f"request {req.index}: num_prompt_tokens={req.num_prompt_tokens} must be >= 1")
    sim = _Simulation(spec, latency, kv_link_bandwidth, kv_overlap)
    sim.run(reqs)
    timings = [_timing(req) for req in reqs]
    num_failed = sum(req.state is State.FAILED for req in reqs)
    return SimResult(
        timings=timings,
        num_completed=len(reqs) - num_failed,
        num_failed=num_failed,
        num_prefill_steps=sim.num_prefill_steps,
        num_decode_steps=sim.num_decode_steps,
        kv_transfer_bytes=sim.kv_transfer_bytes,
        makespan_s=sim.now,
        kv_capacity_tokens=sim.kv_capacity,
        max_kv_tokens_used_per_replica=tuple(r.peak_reserved_tokens for r in sim.kv_pool),
    )
