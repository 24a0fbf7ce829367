"""Ray Serve's request router for the pools, driven by a placement policy (router.placement).

Serve calls ``choose_replicas`` in the caller's process (the router replica) for every call on a
pool handle. The replicas' reports arrive through Serve's routing stats (each pool replica's
``record_routing_stats``, refreshed every ``request_routing_stats_period_s``); Serve's own count
of requests in flight per replica is fresher, so it raises a stale queue length. The policy, a
pure function, ranks the replicas; the ranking goes back to Serve, which sends the request to
the first one with room.
"""

from __future__ import annotations

import logging
from dataclasses import fields

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from common.serving import ReplicaReport, ServeRequest
from router import routing_state
from router.placement import NoReplicaAvailable, PlacementPolicy, PlacementRequest, make_policy

logger = logging.getLogger("pdserve.router")
_REPORT_FIELDS = {f.name for f in fields(ReplicaReport)}


class PolicyRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "least_loaded", role: str = "decode", block_size: int = 16) -> None:
        self.policy: PlacementPolicy = make_policy(policy, block_size=block_size)
        self.role = role
        self.last_reason = ""

    def _report(self, replica: RunningReplica) -> ReplicaReport:
        """The replica's own last report (what /pdserve/status shows)."""
        stats = {k: v for k, v in (replica.routing_stats or {}).items() if k in _REPORT_FIELDS}
        stats["replica_id"] = replica.replica_id.unique_id
        stats.setdefault("role", self.role)
        return ReplicaReport.from_dict(stats)

    def _load_view(self, replica: RunningReplica) -> ReplicaReport:
        """The report as placement sees it: requests sent since it was taken count as waiting."""
        report = self._report(replica)
        in_flight = self.replica_queue_len_cache.get(replica.replica_id) or 0
        known = report.num_running + report.num_waiting + report.num_reserved + report.num_waiting_for_blocks
        if in_flight > known:
            report = ReplicaReport.from_dict(
                {**report.to_dict(), "num_waiting": report.num_waiting + in_flight - known}
            )
        return report

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve pushes replica changes and fresh routing stats here: keep the status view current."""
        super().update_replicas(replicas)
        routing_state.record(self.role, {r.replica_id.unique_id: self._report(r).to_dict() for r in replicas})

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        routing_state.record(self.role, {r.replica_id.unique_id: self._report(r).to_dict() for r in candidate_replicas})
        reports = [self._load_view(r) for r in candidate_replicas]
        request = _placement_request(pending_request)
        try:
            placement = self.policy.choose(request, reports)
        except NoReplicaAvailable as exc:
            logger.warning("no %s replica for %s: %s", self.role, request.request_id, exc)
            return [candidate_replicas]  # let Serve queue it rather than fail here
        self.last_reason = placement.reason
        logger.debug("%s -> %s replica %s: %s", request.request_id, self.role, placement.replica_id, placement.reason)
        return [[by_id[replica_id]] for replica_id in placement.ranking if replica_id in by_id]


def _placement_request(pending: PendingRequest | None) -> PlacementRequest:
    args = pending.args if pending is not None else ()
    request = args[0] if args and isinstance(args[0], ServeRequest) else None
    if request is None:  # reports, health checks: any replica
        return PlacementRequest(request_id="-", num_prompt_tokens=0, prefix_block_hashes=())
    return PlacementRequest(request.request_id, len(request.prompt_token_ids), ())
