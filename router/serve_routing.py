"""Ray Serve's request router for the pools, driven by a placement policy (router.placement).

Serve calls ``choose_replicas`` in the caller's process (the router replica) for every call on a
pool handle. The replicas' reports arrive through Serve's routing stats (each pool replica's
``record_routing_stats``, refreshed every ``request_routing_stats_period_s``); Serve's own count
of requests in flight per replica is fresher, so it raises a stale queue length. The placement
(router.pool_placement: the load view, the prefix index, the policy, a pure function) ranks the
replicas; the ranking goes back to Serve, which sends the request to the first one with room.
"""

from __future__ import annotations

import logging
from dataclasses import fields

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from common.serving import ReplicaReport, ServeRequest
from router import routing_state
from router.placement import NoReplicaAvailable
from router.pool_placement import PoolPlacement
from router.report_ages import ReportAges

logger = logging.getLogger("pdserve.router")
_REPORT_FIELDS = {f.name for f in fields(ReplicaReport)}


# Not FIFOMixin: a replica found free for one request's ranking goes to that request (Serve's
# default matching by request id), not to whichever request waited longest.
class PolicyRequestRouter(RequestRouter):
    def initialize_state(self, policy: str = "cache_aware", role: str = "decode", block_size: int = 16) -> None:
        self.placement = PoolPlacement(policy, role, block_size)
        self.role = role
        routing_state.register_placement(role, self.placement)
        self.report_ages = ReportAges()
        self.last_reason = ""

    def _report(self, replica: RunningReplica) -> ReplicaReport:
        """The replica's own last report (what /pdserve/status shows)."""
        stats = {k: v for k, v in (replica.routing_stats or {}).items() if k in _REPORT_FIELDS}
        stats["replica_id"] = replica.replica_id.unique_id
        stats.setdefault("role", self.role)
        return ReplicaReport.from_dict(stats)

    def _observe(self, replicas: list[RunningReplica], every_replica: bool = False) -> list[ReplicaReport]:
        reports = self.report_ages.mark_silent([self._report(r) for r in replicas], every_replica)
        routing_state.record(self.role, {r.replica_id: r.to_dict() for r in reports})
        self.placement.observe(reports, every_replica)
        return reports

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve pushes replica changes and fresh routing stats here: keep the status view current."""
        super().update_replicas(replicas)
        self._observe(replicas, every_replica=True)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _serve_request(pending_request)
        if request is not None and request.avoid_replicas:
            # An earlier attempt was lost there (dead, or stopped and still looking alive).
            others = [r for r in candidate_replicas if r.replica_id.unique_id not in request.avoid_replicas]
            candidate_replicas = others or candidate_replicas
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        reports = self._observe(candidate_replicas)
        in_flight = {
            r.replica_id.unique_id: self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas
        }
        request_id = request.request_id if request is not None else "-"
        try:
            placement = self.placement.place(request, reports, in_flight)
        except NoReplicaAvailable as exc:
            logger.warning("no %s replica for %s: %s", self.role, request_id, exc)
            return [candidate_replicas]  # let Serve queue it rather than fail here
        self.last_reason = placement.reason
        logger.debug("%s -> %s replica %s: %s", request_id, self.role, placement.replica_id, placement.reason)
        return [[by_id[replica_id]] for replica_id in placement.ranking if replica_id in by_id]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """The replica Serve sent the request to (the ranking's first with room): what the prefix
        index remembers."""
        request = _serve_request(pending_request)
        if request is not None:
            self.placement.routed(request, replica_id.unique_id)


def _serve_request(pending: PendingRequest | None) -> ServeRequest | None:
    args = pending.args if pending is not None else ()
    return args[0] if args and isinstance(args[0], ServeRequest) else None
