"""Which replica of a pool gets a request: placement policies as pure functions over load reports.

The router keeps the latest ``ReplicaReport`` of every replica and asks a policy once per request
(once for the prefill pool and once for the decode pool when disaggregated). A policy only ranks;
it never reserves anything, so a stale report costs at worst a slightly worse choice, and the
replica's own admission control (``OverloadedError``) stays the real limit.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.errors import ConfigError
from common.serving import ReplicaReport

# Weight of a waiting request against a running one: a waiting request still needs its whole
# prefill, and a queue means the replica is already saturated.
WAITING_WEIGHT = 4


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    num_prompt_tokens: int
    # Replica id -> the prompt's leading tokens already in that replica's prefix cache (the router
    # looks them up in router.prefix_index); a cache-aware policy reads it, least-loaded does not.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    replica_id: str
    reason: str  # human-readable, for logs and trace spans
    ranking: tuple[str, ...]  # every eligible replica, best first; the router falls back along it


class NoReplicaAvailable(Exception):
    """No replica can take the request; the message says why (none reported, draining, prompt too long, full)."""


class PlacementPolicy(ABC):
    """Ranks the replicas of one pool for one request.

    Called by the router on its event loop for every request, so ``choose`` must be pure: no I/O,
    no blocking, no mutation of ``request`` or ``replicas`` (reports are shared between calls).
    It returns the best eligible replica plus the full ranking, and raises ``NoReplicaAvailable``
    when no replica is eligible at all. Being the same for the same inputs keeps tests and
    replays deterministic.
    """

    name: str

    @abstractmethod
    def choose(self, request: PlacementRequest, replicas: Sequence[ReplicaReport]) -> Placement: ...


class LeastLoadedPolicy(PlacementPolicy):
    """Fewest queued and running requests first.

    Excludes draining and failed replicas and those whose ``max_model_len`` cannot hold the prompt plus one
    generated token. Decode replicas without enough free KV blocks for the prompt stay eligible but
    rank after every replica that has them: they would have to queue the KV hand-off.
    Score = ``(num_waiting + num_waiting_for_blocks) * WAITING_WEIGHT + num_running + num_reserved``
    (a reservation queued for blocks waits like a queued request); ties go to the lower KV
    usage, then the lower replica id.
    """

    name = "least_loaded"

    def __init__(self, block_size: int = 16) -> None:
        if type(block_size) is not int or block_size < 1:
            raise ConfigError(f"placement block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size

    def choose(self, request: PlacementRequest, replicas: Sequence[ReplicaReport]) -> Placement:
        # The first generated token needs a slot too.
        num_tokens = request.num_prompt_tokens + 1
        num_blocks_needed = -(-num_tokens // self.block_size)
        eligible = [
            r for r in replicas if _takes_requests(r) and (r.max_model_len <= 0 or num_tokens <= r.max_model_len)
        ]
        if not eligible:
            raise NoReplicaAvailable(_why_none(request, replicas))

        def fits_kv(r: ReplicaReport) -> bool:
            return r.role != "decode" or r.num_kv_blocks_free >= num_blocks_needed

        ranked = sorted(eligible, key=lambda r: (not fits_kv(r), _load(r), r.kv_usage, r.replica_id))
        best = ranked[0]
        reason = (
            f"least loaded: {best.num_waiting} waiting, {best.num_running} running, "
            f"{best.num_reserved} reserved, KV {best.kv_usage:.0%} used"
        )
        if not fits_kv(best):
            reason += f"; no decode replica has {num_blocks_needed} free KV blocks ({best.num_kv_blocks_free} here)"
        return Placement(best.replica_id, reason, tuple(r.replica_id for r in ranked))


class CacheAwarePolicy(PlacementPolicy):
    """Prefill (and colocated) replicas: the one that reaches this prompt's first token soonest,
    counting prefix-cache hits. Decode replicas: as least-loaded (free KV blocks, then load).

    Cost = ``prefill_cost(prompt tokens, prompt tokens cached there, prompt tokens queued there)``:
    the prompt tokens the replica must compute before this prompt's last one. A hit saves its
    tokens; a long queue costs its tokens. Ties (no hits, equal queues) go by least-loaded's
    order: load, KV usage, replica id. Same eligibility as least-loaded.
    """

    name = "cache_aware"

    def __init__(self, block_size: int = 16) -> None:
        self.least_loaded = LeastLoadedPolicy(block_size)

    def choose(self, request: PlacementRequest, replicas: Sequence[ReplicaReport]) -> Placement:
        if not replicas or all(r.role == "decode" for r in replicas):
            return self.least_loaded.choose(request, replicas)
        num_tokens = request.num_prompt_tokens + 1
        eligible = [
            r for r in replicas if _takes_requests(r) and (r.max_model_len <= 0 or num_tokens <= r.max_model_len)
        ]
        if not eligible:
            raise NoReplicaAvailable(_why_none(request, replicas))

        def cached(r: ReplicaReport) -> int:
            return min(request.cached_tokens.get(r.replica_id, 0), max(0, request.num_prompt_tokens - 1))

        def cost(r: ReplicaReport) -> int:
            return prefill_cost(request.num_prompt_tokens, cached(r), r.num_prefill_tokens_queued)

        ranked = sorted(eligible, key=lambda r: (cost(r), _load(r), r.kv_usage, r.replica_id))
        best = ranked[0]
        reason = (
            f"cache aware: {cached(best)} of {request.num_prompt_tokens} prompt tokens cached, "
            f"{best.num_prefill_tokens_queued} queued ahead (cost {cost(best)} tokens)"
        )
        return Placement(best.replica_id, reason, tuple(r.replica_id for r in ranked))


def prefill_cost(num_prompt_tokens: int, num_cached_tokens: int, num_queued_tokens: int) -> int:
    """Prompt tokens a replica computes before this prompt's first token: those queued ahead of it,
    then the prompt's own that its prefix cache does not hold. Prefill is compute-bound, so its
    time grows with tokens (attention's quadratic share is small at the prompt lengths served)."""
    return num_queued_tokens + max(0, num_prompt_tokens - num_cached_tokens)


class RandomPolicy(PlacementPolicy):
    """Any eligible replica, by a hash of the request id (the same request ranks the same way):
    the baseline a cache-aware policy is measured against."""

    name = "random"

    def __init__(self, block_size: int = 16) -> None:
        self.least_loaded = LeastLoadedPolicy(block_size)

    def choose(self, request: PlacementRequest, replicas: Sequence[ReplicaReport]) -> Placement:
        ordered = self.least_loaded.choose(request, replicas).ranking  # eligibility, as least-loaded's

        def draw(replica_id: str) -> bytes:
            return hashlib.blake2b(f"{request.request_id}/{replica_id}".encode(), digest_size=8).digest()

        ranking = tuple(sorted(ordered, key=draw))
        return Placement(ranking[0], "random", ranking)


def _load(r: ReplicaReport) -> int:
    return (r.num_waiting + r.num_waiting_for_blocks) * WAITING_WEIGHT + r.num_running + r.num_reserved


def _takes_requests(r: ReplicaReport) -> bool:
    """Neither draining nor failed (its engine stopped: Serve's health check replaces it soon)."""
    return not r.draining and not r.engine_error


def _why_none(request: PlacementRequest, replicas: Sequence[ReplicaReport]) -> str:
    if not replicas:
        return "no replicas have reported yet"
    num_draining = sum(r.draining for r in replicas)
    num_failed = sum(bool(r.engine_error) and not r.draining for r in replicas)
    if num_draining == len(replicas):
        return f"all {num_draining} replicas are draining"
    if num_draining + num_failed == len(replicas):
        return (
            f"of {len(replicas)} replicas, {num_failed} failed (their engines stopped) and {num_draining} are draining"
        )
    longest = max(r.max_model_len for r in replicas if _takes_requests(r))
    return (
        f"a prompt of {request.num_prompt_tokens} tokens (+1 generated) does not fit any replica: "
        f"{num_draining} draining, {num_failed} failed, the others hold at most {longest} tokens (max_model_len)"
    )


POLICIES: dict[str, type[PlacementPolicy]] = {
    "least_loaded": LeastLoadedPolicy,
    "cache_aware": CacheAwarePolicy,
    "random": RandomPolicy,
}


def make_policy(name: str, **kwargs: Any) -> PlacementPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ConfigError(f"unknown placement policy {name!r}; set it to one of: {known}") from None
    return cls(**kwargs)
