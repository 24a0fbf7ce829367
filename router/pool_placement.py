"""One pool's placement, as the router runs it for every call on the pool's handle (Serve-free).

    reports (+ requests in flight per replica) ─▶ load view ─┐
    the prompt ─▶ its blocks' short hashes ─▶ prefix index ──┴▶ policy.choose ─▶ Placement
                                                                      └▶ remembered as routed

The load view corrects each replica's last report (up to a second old) with what the router did
since: requests it sent that the report does not count wait as queued, and the prompt tokens it
sent count as queued prefill, drained at the replica's measured prefill rate. router.serve_routing
plugs this into Ray Serve's request router; bench.placement times it alone.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from common.block_hash import hash_full_blocks, short_hashes
from common.serving import RemotePrefillEstimate, ReplicaReport, ServeRequest
from router.placement import NoReplicaAvailable, Placement, PlacementPolicy, PlacementRequest, make_policy
from router.prefix_index import PrefixIndex, hashes_as_ints

_REMEMBERED_PROMPTS = 256  # prompts whose block hashes are kept (Serve asks again on each backoff round)
# A replica reports every second; past a few periods without one, its queue is not assumed to drain
# further (a replica whose engine is stuck stops reporting, and must not look idle).
MAX_DRAIN_S = 3.0


def estimated_queued_tokens(reported: int, routed_since: int, tokens_per_s: float, seconds_since: float) -> int:
    """Prompt tokens a replica still has to compute now: those its report counted plus those routed
    to it since, less what it computed meanwhile at its measured rate (no rate yet: nothing drains),
    for at most MAX_DRAIN_S."""
    drained = tokens_per_s * min(MAX_DRAIN_S, max(0.0, seconds_since))
    return max(0, int(reported + routed_since - drained))


class PoolPlacement:
    def __init__(self, policy: str | PlacementPolicy, role: str, block_size: int = 16) -> None:
        self.policy = make_policy(policy, block_size=block_size) if isinstance(policy, str) else policy
        self.role = role
        self.block_size = block_size
        self.uses_prefixes = role != "decode"  # a decode replica's prefix cache is not used for hand-offs
        self.prefix_index = PrefixIndex()
        # request id -> its prompt's short hashes, and the same as 64-bit ints (hashed once a request)
        self._prompt_blocks: OrderedDict[str, tuple[list[bytes], np.ndarray]] = OrderedDict()
        self._expected: OrderedDict[str, str] = OrderedDict()  # request id -> the replica it was ranked first on
        self._reports: Sequence[ReplicaReport] = ()  # the last seen, for estimate()
        # Serve ranks on its router thread, while the router's own loop asks for estimates (and the
        # prefix index ages its memory as it reads): one caller at a time.
        self._lock = threading.Lock()

    def observe(self, reports: Sequence[ReplicaReport], every_replica: bool = False) -> None:
        """Fresh reports; ``every_replica``: these are all the pool's replicas (forget the others)."""
        with self._lock:
            self._observe(reports, every_replica)

    def place(
        self, request: ServeRequest | None, reports: Sequence[ReplicaReport], in_flight: Mapping[str, int]
    ) -> Placement:
        """Rank the replicas for ``request`` (None: a report or health call, any replica). Raises
        NoReplicaAvailable as the policy does. Call ``routed`` once the request is on a replica."""
        with self._lock:
            return self._place(request, reports, in_flight)

    def estimate(self, request: ServeRequest) -> RemotePrefillEstimate | None:
        """What ``request``'s prompt would cost on the replica this pool would place it on now (a
        read: nothing is remembered as routed), with ``overhead_s`` 0 for the caller to fill in.
        None while no replica can take it or has measured its prefill rate."""
        with self._lock:
            return self._estimate(request)

    def routed(self, request: ServeRequest, replica_id: str) -> None:
        """``request`` went to ``replica_id``."""
        with self._lock:
            self._routed(request, replica_id)

    def _observe(self, reports: Sequence[ReplicaReport], every_replica: bool = False) -> None:
        self._reports = reports
        if not self.uses_prefixes:
            return
        for report in reports:
            self.prefix_index.update(report.replica_id, report.cached_blocks)
        if every_replica:
            self.prefix_index.keep_only(r.replica_id for r in reports)

    def _place(
        self, request: ServeRequest | None, reports: Sequence[ReplicaReport], in_flight: Mapping[str, int]
    ) -> Placement:
        now = time.time()
        views = [self._load_view(r, in_flight.get(r.replica_id, 0), now) for r in reports]
        if request is None:
            return self.policy.choose(PlacementRequest(request_id="-", num_prompt_tokens=0), views)
        blocks, cached = self._cached_tokens(request, views, now)
        placement = self.policy.choose(
            PlacementRequest(request.request_id, len(request.prompt_token_ids), cached), views
        )
        if self.uses_prefixes and request.request_id not in self._expected:
            # Remembered at once as going to the ranking's first: the requests of a burst are ranked
            # before Serve has sent any of them, and must see each other's prompts to spread.
            self._remember(request, placement.replica_id, blocks, cached.get(placement.replica_id, 0), now)
            self._expected[request.request_id] = placement.replica_id
            if len(self._expected) > _REMEMBERED_PROMPTS:
                self._expected.popitem(last=False)
        return placement

    def _estimate(self, request: ServeRequest) -> RemotePrefillEstimate | None:
        now = time.time()
        views = [self._load_view(r, 0, now) for r in self._reports]
        _, cached = self._cached_tokens(request, views, now)
        try:
            placement = self.policy.choose(
                PlacementRequest(request.request_id, len(request.prompt_token_ids), cached), views
            )
        except NoReplicaAvailable:
            return None
        best = next(v for v in views if v.replica_id == placement.replica_id)
        if best.prefill_tokens_per_s <= 0:
            return None
        return RemotePrefillEstimate(
            replica_id=best.replica_id,
            num_queued_tokens=best.num_prefill_tokens_queued,
            num_cached_tokens=cached[best.replica_id],
            tokens_per_s=best.prefill_tokens_per_s,
            overhead_s=0.0,
        )

    def _routed(self, request: ServeRequest, replica_id: str) -> None:
        """Usually the ranking's first, already remembered; when
        Serve took another (the first was full), the prompt is remembered there too."""
        if not self.uses_prefixes or self._expected.pop(request.request_id, None) == replica_id:
            return
        now = time.time()
        blocks, ints = self._blocks_of(request)
        cached = self.prefix_index.cached_prefix_blocks(replica_id, blocks, now, ints) * self.block_size
        self._remember(request, replica_id, blocks, cached, now)

    def _cached_tokens(
        self, request: ServeRequest, views: Sequence[ReplicaReport], now: float
    ) -> tuple[list[bytes], dict[str, int]]:
        """The prompt's block hashes, and per replica the prompt tokens its prefix cache holds."""
        blocks, ints = self._blocks_of(request) if self.uses_prefixes else ([], None)
        cached = {
            r.replica_id: self.prefix_index.cached_prefix_blocks(r.replica_id, blocks, now, ints) * self.block_size
            for r in views
        }
        return blocks, cached

    def _remember(self, request: ServeRequest, replica_id: str, blocks: list[bytes], cached: int, now: float) -> None:
        num_prompt = len(request.prompt_token_ids)
        self.prefix_index.routed(replica_id, blocks, num_prompt - min(cached, num_prompt), now)

    def _load_view(self, report: ReplicaReport, in_flight: int, now: float) -> ReplicaReport:
        """The report as placement sees it now (see the module docstring)."""
        known = report.num_running + report.num_waiting + report.num_reserved + report.num_waiting_for_blocks
        routed = self.prefix_index.tokens_routed_since(report.replica_id, report.report_time, now)
        queued = estimated_queued_tokens(
            report.num_prefill_tokens_queued, routed, report.prefill_tokens_per_s, now - report.report_time
        )
        if in_flight <= known and queued == report.num_prefill_tokens_queued:
            return report
        return dataclasses.replace(
            report, num_waiting=report.num_waiting + max(0, in_flight - known), num_prefill_tokens_queued=queued
        )

    def _blocks_of(self, request: ServeRequest) -> tuple[list[bytes], np.ndarray]:
        """The prompt's full blocks' short hashes, as its engine will hash them (salt included),
        and the same as 64-bit ints."""
        found = self._prompt_blocks.get(request.request_id)
        if found is None:
            hashes = short_hashes(hash_full_blocks(request.prompt_token_ids, self.block_size, request.cache_salt))
            found = self._prompt_blocks[request.request_id] = (hashes, hashes_as_ints(hashes))
            if len(self._prompt_blocks) > _REMEMBERED_PROMPTS:
                self._prompt_blocks.popitem(last=False)
        return found
