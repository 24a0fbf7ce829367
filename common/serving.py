"""Messages between the router and the pools (Ray Serve calls). Torch-free, plain types only.

    router ──ServeRequest──▶ decode replica  .generate()  ─▶ TicketIssued, then StreamDelta…
    router ──ServeRequest(kv_ticket)──▶ prefill replica .prefill() ─▶ PrefillResult
    every replica ──ReplicaReport──▶ Serve controller ─▶ the router's placement policy

Each message is sent whole once; token streams carry deltas only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from common.outputs import TokenLogprob

# What the router does with a request whose KV hand-off failed (router.kv_load_failure_policy):
# retry it with the prompt computed on its decode replica, or end it with the error.
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# The kind a decode replica's error starts with ("kind: message") when a request's KV never loaded.
KV_LOAD_FAILED = "kv_load_failed"


@dataclass(frozen=True, slots=True)
class ServeRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams.to_dict()
    cache_salt: str | None = None
    # Prefill only: where to push the KV. Out of the repr: it holds the transfer's secret.
    kv_ticket: dict[str, Any] | None = field(default=None, repr=False)
    trace_context: dict[str, str] | None = None  # W3C traceparent/tracestate of the caller's span
    # Decode only, with conditional disaggregation: the router's estimate of the prefill pool's
    # path; the decode replica weighs it against computing the prompt itself. None: always remote.
    remote_prefill: RemotePrefillEstimate | None = None
    # Decode only: compute the prompt here, whatever the estimate (the prefill pool failed this
    # request's previous attempt, or has no replica that takes requests).
    prefill_here: bool = False
    # Replicas (Serve unique ids) an earlier attempt of this request was lost on, dead or silent:
    # placement takes another while one is there (a stopped replica looks alive for seconds).
    avoid_replicas: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RemotePrefillEstimate:
    """What the prompt would cost on the prefill pool's best replica, as the router sees it now."""

    replica_id: str
    num_queued_tokens: int  # prompt tokens queued ahead of it there
    num_cached_tokens: int  # of this prompt, in that replica's prefix cache
    tokens_per_s: float  # the replica's measured prefill rate (> 0)
    # Measured at the router (a moving average over disaggregated requests): their TTFT less the
    # prefill replica's queue and compute, i.e. the reservation, the hops and the exposed KV transfer.
    overhead_s: float

    def seconds(self, num_prompt_tokens: int) -> float:
        """Time to this prompt's first token by the remote path."""
        to_compute = self.num_queued_tokens + max(1, num_prompt_tokens - self.num_cached_tokens)
        return to_compute / self.tokens_per_s + self.overhead_s


@dataclass(frozen=True, slots=True)
class TicketIssued:
    """First item of a disaggregated decode stream: blocks are reserved, send the prompt's KV here."""

    request_id: str
    ticket: dict[str, Any] = field(repr=False)  # kv_transfer.KVTicket.to_dict(); holds its secret
    replica_id: str


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one engine step added to a request. The last one has ``finish_reason`` set."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] | None = None  # one per new token when asked for
    # prompt_logprobs, on the first delta with a token: [i] scores prompt token i + 1.
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    replica_id: str = ""
    # On the finished delta only, from the engine that ran the request: arrival to first scheduled,
    # and first scheduled to first token (colocated: the prompt's queue and prefill times).
    queue_time_s: float | None = None
    prefill_time_s: float | None = None
    # The router's own, never sent by a pool. On an attempt's finished delta: the reply of the prefill
    # replica that ran its prompt (disaggregated). On the finished delta the router passes on: where
    # the request's time to first token went (router.ttft).
    prefill_reply: PrefillResult | None = None
    ttft_breakdown: TTFTBreakdown | None = None
    index: int = 0  # the router's: which choice of the answer (n > 1, a batch of prompts)


@dataclass(frozen=True, slots=True)
class TTFTBreakdown:
    """A request's time to first token as the router measured it, split where it went. A part is None
    where it is not known or did not happen (no KV moved, prefill's reply lost); ``other_s`` is the
    rest, never negative: the router, the hops, the decode replica's first emission."""

    queue_s: float | None  # on the replica that ran the prompt: arrival to its first chunk scheduled
    prefill_s: float | None  # first chunk scheduled to the prompt computed
    kv_transfer_exposed_s: float | None  # prompt computed to its KV acknowledged: what overlap did not hide
    other_s: float


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A prefill replica's answer once the prompt is computed and its KV hand-off has ended."""

    request_id: str
    first_token_id: int | None
    num_cached_tokens: int
    error: str | None = None  # the hand-off failed; the decode side ends the request too
    replica_id: str = ""
    first_logprob: TokenLogprob | None = None  # when asked for: the decode side does not get it
    prompt_logprobs: list[TokenLogprob] | None = None  # the same: the prompt ran here
    queue_time_s: float | None = None  # arrival on the replica to the first chunk scheduled
    prefill_time_s: float | None = None  # first chunk scheduled to the prompt computed
    kv_bytes: int = 0  # KV this replica's shards sent, all of them together
    kv_transfer_s: float | None = None  # first chunk sent to the last acknowledged (slowest shard)
    kv_exposed_s: float | None = None  # prompt computed to hand-off acknowledged: what overlap did not hide


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """One replica's load and cache state, refreshed every second or so.

    Carries what both the least-loaded policy and the cache-aware one need: queue lengths, the
    prompt tokens still to prefill, KV blocks free, and every block in its prefix cache (the
    short hashes of common.block_hash, packed).
    """

    replica_id: str
    role: str  # prefill | decode | colocated
    num_running: int = 0
    num_waiting: int = 0
    num_reserved: int = 0  # decode: blocks held for KV still arriving
    num_waiting_for_blocks: int = 0  # decode: reservations queued until blocks free
    num_kv_blocks_free: int = 0
    num_kv_blocks_total: int = 0
    num_blocks_held: int = 0  # referenced by requests (prefix-cached free blocks excluded)
    max_model_len: int = 0
    draining: bool = False
    engine_error: str = ""  # why the replica's engine stopped ("" while it runs): placement skips it
    pid: int = 0  # the replica's process (rank 0), for operators
    shard_pids: list[int] = field(default_factory=list)  # its tensor-parallel shards' processes, ranks 1..
    cached_blocks: bytes = b""  # common.block_hash.pack_short_hashes of every cached block
    num_prefill_tokens_queued: int = 0  # prompt tokens of waiting and prefilling requests not computed yet
    prefill_tokens_per_s: float = 0.0  # how fast it computes prompt tokens (measured; 0: not yet)
    report_time: float = 0.0  # time.time() when the replica took the report
    # Counts the reports the replica answered: one that stops changing is a replica that stopped
    # answering (hung, not dead), seen on the router's own clock (router.report_ages).
    report_seq: int = 0
    prefix_cache_hit_rate: float = 0.0
    cpu_cores: list[int] = field(default_factory=list)  # CPU: the cores the replica runs on
    cpu_cores_shared: list[int] = field(default_factory=list)  # of those, shared (oversubscribed)
    # Counters since the replica started (a scraper takes their rates).
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    num_handoff: int = 0  # prefill: requests whose KV is on the wire (tickets outstanding)
    num_kv_lease_expirations: int = 0
    num_prefills_expired: int = 0  # prefill: prompts dropped uncomputed, their KV lease run out
    num_kv_pushes_cancelled: int = 0  # prefill: KV pushes cut off mid-prompt (request aborted or preempted)
    num_kv_transfer_failures: int = 0
    num_steps: int = 0  # forward passes run
    num_steps_ahead: int = 0  # of those, queued before the one before them was read (async scheduling)
    # Constrained decoding (engine/structured_output): grammars compiled and their seconds, compiles
    # a cached grammar spared, tokens sampled under a mask, requests a constraint ended at a dead end.
    num_grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    num_grammar_cache_hits: int = 0
    num_constrained_tokens: int = 0
    num_constraint_dead_ends: int = 0

    @property
    def kv_usage(self) -> float:
        return 0.0 if not self.num_kv_blocks_total else 1.0 - self.num_kv_blocks_free / self.num_kv_blocks_total

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaReport:
        return cls(**data)
