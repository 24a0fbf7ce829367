"""What every pool replica shares, Ray-free: an engine on its own thread, its report, health, shutdown.

The pools' Serve deployment classes (prefill_pool.server, decode_pool.server) extend this with
their request methods; Serve calls ``record_routing_stats`` and ``check_health`` by name.
"""

from __future__ import annotations

import os

from common.serving import ReplicaReport
from engine.async_engine import AsyncEngine, load_report


class EngineReplica:
    def __init__(self, engine: AsyncEngine, replica_id: str) -> None:
        self.engine = engine
        self.replica_id = replica_id
        self.draining = False

    async def report(self) -> dict:
        fields = await self.engine.call(load_report, timeout_s=10)
        return ReplicaReport(replica_id=self.replica_id, draining=self.draining, pid=os.getpid(), **fields).to_dict()

    async def record_routing_stats(self) -> dict:
        return await self.report()

    async def num_blocks_held(self) -> int:
        return await self.engine.call(lambda e: e.num_blocks_held(), timeout_s=10)

    def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise RuntimeError(f"{self.engine.engine.role.value} engine failed: {self.engine.error}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def serve_replica_id() -> str:
    """This replica's id under Ray Serve; "local" outside it. Ray is looked up, not imported."""
    import sys

    serve = sys.modules.get("ray.serve")
    if serve is None:
        return "local"
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a replica
        return "local"
