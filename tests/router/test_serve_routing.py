"""router.serve_routing's choice among the replicas Serve offers: the placement's ranking, less the
replicas an earlier attempt of the same request was lost on (while another is there)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import NamedTuple

from common.serving import ServeRequest
from router.pool_placement import PoolPlacement
from router.report_ages import ReportAges
from router.serve_routing import PolicyRequestRouter


def _router() -> PolicyRequestRouter:
    # Serve's RequestRouter needs a running deployment to construct: only what choose_replicas reads.
    router = object.__new__(PolicyRequestRouter)
    router.placement = PoolPlacement("least_loaded", "decode", 16)
    router.role = "decode"
    router.report_ages = ReportAges()
    router._replica_queue_len_cache = {}  # Serve's own, behind its replica_queue_len_cache property
    return router


class _ReplicaId(NamedTuple):  # hashable, as Serve's ReplicaID
    unique_id: str


def _replica(unique_id: str):
    stats = {"role": "decode", "report_seq": 1, "num_kv_blocks_free": 10, "num_kv_blocks_total": 10}
    return SimpleNamespace(replica_id=_ReplicaId(unique_id), routing_stats=stats)


def _choose(router, replicas, request):
    pending = SimpleNamespace(args=(request,))
    return [[r.replica_id.unique_id for r in rank] for rank in asyncio.run(router.choose_replicas(replicas, pending))]


def test_a_replica_an_attempt_was_lost_on_is_not_offered_again_while_another_is_there():
    router, replicas = _router(), [_replica("a"), _replica("b")]
    fresh = ServeRequest("r.0", [1, 2, 3], {})
    assert {rank[0] for rank in _choose(router, replicas, fresh)} == {"a", "b"}
    resumed = ServeRequest("r.1", [1, 2, 3], {}, avoid_replicas=("a",))
    assert _choose(router, replicas, resumed) == [["b"]]
    # The only replica left is offered anyway (Serve may have replaced the rest with it).
    assert _choose(router, [_replica("a")], resumed) == [["a"]]
