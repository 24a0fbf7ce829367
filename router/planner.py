"""The SLO planner: how many prefill and decode replicas hold the SLOs, decided for both pools at once.

Every ``interval_s`` the router folds what it saw into an ``Observation``: the share of requests
since the last one that met the TTFT SLO and the TPOT SLO (a failed or refused request meets
neither), and each pool's latest replica reports. ``plan`` turns it into each pool's target count
and the reason, DistServe's split of the work: TTFT is the prefill pool's, TPOT the decode pool's.

    up     a pool whose queue says the SLO will be missed, or whose attainment is under target:
           prefill, the prompt tokens queued need more replicas than the pool has to be computed
           within the TTFT SLO (at the rate the replicas measure): as many as they need, at
           once, so a burst is met in one resize; decode, reservations wait for KV blocks or KV
           usage is above ``kv_high``: one more. Acted on after ``up_after`` intervals in a row.
    down   a pool that meets its SLO and would fit in one replica fewer (prefill: nothing queued;
           decode: its KV usage spread over one replica fewer stays under ``kv_low``), for
           ``down_after`` intervals in a row and ``cooldown_s`` after the pool's last change:
           one fewer. Serve drains the replica that leaves (no new requests; those in flight end).
    bounds each pool within [min, max]; both pools together within ``budget`` shards (cores or
           GPUs: a replica is tensor_parallel_size shards). When both want more than the budget
           has, the pool further under its attainment target goes first.

Up needs one interval, down six and a cooldown, and the thresholds differ (``kv_high`` >
``kv_low``): a load that sits between them changes nothing, so the counts do not oscillate.
A pure function over plain data: the router's loop (``router.server``) acts on its decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.errors import ConfigError

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PlannerConfig:
    enabled: bool = False
    interval_s: float = 10.0
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    target_attainment: float = 0.9  # of requests meeting each SLO
    min_samples: int = 5  # requests an interval needs before its attainment counts
    min_replicas: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    max_replicas: dict[str, int] = field(default_factory=lambda: {"prefill": 4, "decode": 4})
    # Both pools together: cores on a local CPU cluster (a replica counts the cores it owns; None:
    # the host's), else shards (a replica is tensor_parallel_size of them: GPUs on CUDA; None: no cap).
    budget: int | None = None
    kv_high: float = 0.85
    kv_low: float = 0.5
    # Prefill shrinks only while the prompt tokens arriving stay under this share of what one
    # replica fewer computes (the queue is a snapshot: often empty under a load that needs them all).
    prefill_low: float = 0.5
    up_after: int = 1
    down_after: int = 6
    cooldown_s: float = 60.0

    def __post_init__(self) -> None:
        # A pool left out of min_replicas or max_replicas keeps its default.
        for name, default in (("min_replicas", 1), ("max_replicas", 4)):
            given = getattr(self, name)
            if (
                not isinstance(given, dict)
                or not set(given) <= set(POOLS)
                or not all(type(count) is int for count in given.values())
            ):
                raise ConfigError(f"{name}={given!r} must map {' and '.join(POOLS)} to integer replica counts")
            object.__setattr__(self, name, {pool: given.get(pool, default) for pool in POOLS})
        problems = [
            self.interval_s <= 0 and "interval_s must be > 0",
            not (self.ttft_slo_s > 0 and self.tpot_slo_s > 0) and "the SLOs must be > 0 seconds",
            not 0 < self.target_attainment <= 1 and "target_attainment must be in (0, 1]",
            not 0 < self.kv_low < self.kv_high <= 1 and "need 0 < kv_low < kv_high <= 1",
            not 0 < self.prefill_low < 1 and "prefill_low must be in (0, 1)",
            (self.up_after < 1 or self.down_after < 1) and "up_after and down_after must be >= 1",
            self.budget is not None and self.budget < 2 and "budget must hold a replica of each pool",
        ]
        for pool in POOLS:
            low, high = self.min_replicas[pool], self.max_replicas[pool]
            if not 1 <= low <= high:
                problems.append(f"{pool}: need 1 <= min_replicas ({low}) <= max_replicas ({high})")
        problem = next((p for p in problems if p), None)
        if problem:
            raise ConfigError(problem)


@dataclass(frozen=True)
class PoolState:
    """One pool as its replicas last reported it."""

    replicas: int
    shards_per_replica: int = 1
    queued_prompt_tokens: int = 0  # prefill: prompt tokens waiting or being computed, all replicas
    prefill_tokens_per_s: float = 0.0  # prefill: one replica's measured rate (0: not yet measured)
    waiting_for_blocks: int = 0  # decode: reservations queued until KV blocks free
    kv_usage: float = 0.0  # decode: the mean share of KV blocks in use
    prompt_tokens_per_s: float | None = None  # prefill: arriving over the last interval (None: unknown)


@dataclass(frozen=True)
class Observation:
    now: float
    ttft_attainment: float | None  # None: too few requests this interval to tell
    tpot_attainment: float | None
    pools: dict[str, PoolState]


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    target: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down" if self.target < self.current else "hold"


@dataclass
class PlannerState:
    """What ``plan`` remembers between intervals (the hysteresis)."""

    up_streak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(POOLS, 0))
    down_streak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(POOLS, 0))
    last_change: dict[str, float] = field(default_factory=lambda: dict.fromkeys(POOLS, -math.inf))


def _wants(pool: str, seen: PoolState, attainment: float | None, config: PlannerConfig) -> tuple[int, str, bool]:
    """The replicas the pool's own signals ask for (before bounds and budget), why, and whether a
    queue asks (a burst: it goes first for the budget, before a short attainment)."""
    n = seen.replicas
    missed = attainment is not None and attainment < config.target_attainment
    if pool == "prefill":
        rate = seen.prefill_tokens_per_s
        if seen.queued_prompt_tokens and rate > 0:
            # Replicas that compute the queue within the TTFT SLO, each at the measured rate.
            needed = math.ceil(seen.queued_prompt_tokens / (rate * config.ttft_slo_s))
            if needed > n:
                return needed, f"{seen.queued_prompt_tokens} prompt tokens queued need {needed} replicas", True
        if missed:
            return n + 1, f"TTFT attainment {attainment:.2f} < {config.target_attainment}", False
        arriving = seen.prompt_tokens_per_s  # None (unknown) or a rate still unmeasured: no shrink
        light = arriving is not None and arriving < config.prefill_low * rate * (n - 1)
        if n > 1 and not seen.queued_prompt_tokens and light:
            return n - 1, f"{arriving:.0f} prompt tokens/s fit in {n - 1} replicas under {config.prefill_low}", False
        return n, "holds", False
    if seen.waiting_for_blocks:
        return n + 1, f"{seen.waiting_for_blocks} reservations wait for KV blocks", True
    if seen.kv_usage > config.kv_high:
        return n + 1, f"KV usage {seen.kv_usage:.2f} > {config.kv_high}", True
    if missed:
        return n + 1, f"TPOT attainment {attainment:.2f} < {config.target_attainment}", False
    if n > 1 and seen.kv_usage * n / (n - 1) < config.kv_low:
        return n - 1, f"KV usage {seen.kv_usage:.2f} fits in {n - 1} replicas under {config.kv_low}", False
    return n, "holds", False


def plan(observation: Observation, config: PlannerConfig, state: PlannerState) -> dict[str, Decision]:
    """Each pool's target replica count for ``observation``; updates ``state``."""
    attainment = {"prefill": observation.ttft_attainment, "decode": observation.tpot_attainment}
    wanted: dict[str, tuple[int, str]] = {}
    queued: dict[str, bool] = {}
    for pool in POOLS:
        seen = observation.pools[pool]
        want, reason, queued[pool] = _wants(pool, seen, attainment[pool], config)
        low, high = config.min_replicas[pool], config.max_replicas[pool]
        bounded = min(max(want, low), high)
        if bounded != want:
            reason += f" (bounded to [{low}, {high}])"
        up, down = bounded > seen.replicas, bounded < seen.replicas
        state.up_streak[pool] = state.up_streak[pool] + 1 if up else 0
        state.down_streak[pool] = state.down_streak[pool] + 1 if down else 0
        if up and state.up_streak[pool] < config.up_after:
            bounded, reason = seen.replicas, f"{reason}; waits {config.up_after} intervals"
        elif down and (
            state.down_streak[pool] < config.down_after or observation.now - state.last_change[pool] < config.cooldown_s
        ):
            bounded, reason = seen.replicas, f"{reason}; holds for the hysteresis"
        wanted[pool] = (bounded, reason)

    # The budget: growth is granted in order of need (a queue first, then the attainment furthest
    # under its target: a burst's attainment is mostly unknown yet, few of its requests have ended).
    used = sum(observation.pools[p].replicas * observation.pools[p].shards_per_replica for p in POOLS)
    freed = sum(
        (observation.pools[p].replicas - wanted[p][0]) * observation.pools[p].shards_per_replica
        for p in POOLS
        if wanted[p][0] < observation.pools[p].replicas
    )
    left = math.inf if config.budget is None else config.budget - used + freed
    growing = [p for p in POOLS if wanted[p][0] > observation.pools[p].replicas]
    growing.sort(key=lambda p: (not queued[p], attainment[p] if attainment[p] is not None else 1.0))
    for pool in growing:
        seen = observation.pools[pool]
        target, reason = wanted[pool]
        asked = target - seen.replicas
        granted = asked if left == math.inf else max(0, min(asked, int(left // seen.shards_per_replica)))
        if granted < asked:
            reason += f"; the budget of {config.budget} allows {granted} more"
        wanted[pool] = (seen.replicas + granted, reason)
        left -= granted * seen.shards_per_replica
    decisions = {p: Decision(p, observation.pools[p].replicas, *wanted[p]) for p in POOLS}
    for decision in decisions.values():
        if decision.target != decision.current:
            state.last_change[decision.pool] = observation.now
            state.up_streak[decision.pool] = state.down_streak[decision.pool] = 0
    return decisions


class SLOWindow:
    """The requests that ended since the last ``take``: how many met the TTFT SLO, of all of them (a
    failed or refused request is a miss), and the TPOT SLO, of those that got a first token (one of a
    single token meets it); and their prompt tokens (the load that arrived)."""

    def __init__(self, ttft_slo_s: float, tpot_slo_s: float) -> None:
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.ended = self.ttft_met = self.decoded = self.tpot_met = self.prompt_tokens = 0

    def request_ended(
        self, ok: bool, ttft_s: float | None = None, tpot_s: float | None = None, prompt_tokens: int = 0
    ) -> None:
        self.ended += 1
        self.prompt_tokens += prompt_tokens
        self.ttft_met += ok and ttft_s is not None and ttft_s <= self.ttft_slo_s
        if ok and ttft_s is not None:
            self.decoded += 1
            self.tpot_met += tpot_s is None or tpot_s <= self.tpot_slo_s

    def take(self, min_samples: int) -> tuple[float | None, float | None, int]:
        """(TTFT attainment, TPOT attainment, prompt tokens) since the last take; an attainment is
        None with fewer than ``min_samples`` requests behind it."""
        enough = max(1, min_samples)
        ttft = self.ttft_met / self.ended if self.ended >= enough else None
        tpot = self.tpot_met / self.decoded if self.decoded >= enough else None
        prompt_tokens = self.prompt_tokens
        self.ended = self.ttft_met = self.decoded = self.tpot_met = self.prompt_tokens = 0
        return ttft, tpot, prompt_tokens


def pool_state(reports: list[dict], shards_per_replica: int = 1) -> PoolState:
    """A pool as its replicas' latest reports (common.serving.ReplicaReport dicts) tell it; the
    draining ones are leaving and the failed ones (their engine stopped) serve nothing: neither counts."""
    live = [r for r in reports if not r.get("draining") and not r.get("engine_error")]
    rates = [r.get("prefill_tokens_per_s", 0.0) for r in live if r.get("prefill_tokens_per_s", 0.0) > 0]
    usage = [
        1.0 - r.get("num_kv_blocks_free", 0) / r["num_kv_blocks_total"] for r in live if r.get("num_kv_blocks_total")
    ]
    return PoolState(
        replicas=max(1, len(live)),
        shards_per_replica=shards_per_replica,
        queued_prompt_tokens=sum(r.get("num_prefill_tokens_queued", 0) for r in live),
        prefill_tokens_per_s=sum(rates) / len(rates) if rates else 0.0,
        waiting_for_blocks=sum(r.get("num_waiting_for_blocks", 0) for r in live),
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
    )
