"""What every pool replica shares, Ray-free: an engine on its own thread, its report, health, shutdown.

The pools' Serve deployment classes (prefill_pool.server, decode_pool.server) extend this with
their request methods; Serve calls ``record_routing_stats`` and ``check_health`` by name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

from common import env
from common.block_hash import pack_short_hashes, short_hashes
from common.config import EngineConfig
from common.cpu_cores import CoreClaim, claim_cores, format_core_list
from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from common.serving import ReplicaReport
from engine.async_engine import AsyncEngine
from engine.distributed.parallel import pick_device
from engine.executor import WorkerLauncher
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def claim_replica_cores(config: EngineConfig, num_cores: int | None) -> tuple[EngineConfig, CoreClaim | None]:
    """On CPU, claim ``num_cores`` cores of this host for the replica (before its engine exists, so
    every shard is pinned from its start); the config then names them. CUDA, or no count: as is."""
    if num_cores is None or pick_device(config.model.device).type != "cpu":
        return config, None
    claim = claim_cores(num_cores, env.core_lock_dir())
    logger.info("replica owns CPU core(s) %s", format_core_list(claim.cores))
    parallel = dataclasses.replace(config.parallel, cpu_cores=claim.cores)
    return dataclasses.replace(config, parallel=parallel), claim


def start_replica_engine(
    config: EngineConfig, launcher: WorkerLauncher | None, num_cores: int | None, **options: Any
) -> tuple[AsyncEngine, CoreClaim | None]:
    """The replica's engine on its thread, on the cores claimed for it; the claim is given back if
    the engine cannot start. ``options`` go to AsyncEngine."""
    config, claim = claim_replica_cores(config, num_cores)
    try:
        return AsyncEngine(lambda: LLMEngine(config, launcher), **options), claim
    except BaseException:
        if claim is not None:
            claim.release()
        raise


class EngineReplica:
    def __init__(self, engine: AsyncEngine, replica_id: str, core_claim: CoreClaim | None = None) -> None:
        self.engine = engine
        self.replica_id = replica_id
        self.core_claim = core_claim  # held for the replica's life; its locks die with the process
        self.draining = False
        # The prefix cache's short hashes, replayed from the engine's KV events (event loop only).
        self._cached_blocks: dict[bytes, None] = {}
        self._packed: bytes | None = b""
        self._kv_events_lost_seen = 0
        self._cache_lock = asyncio.Lock()  # one replay at a time: a resync awaits the engine
        self._report_seq = 0

    async def report(self, include_cache: bool = False) -> dict:
        """The replica's ReplicaReport as a dict; ``include_cache``: with every cached block's short
        hash (what Serve's routing stats carry to the router's cache-aware placement)."""
        fields = self.engine.snapshot  # published after every step (with its time): no wait behind a long prefill
        self._report_seq += 1  # a live process answers while its engine computes; a hung one does not
        packed = b""
        if include_cache and self.engine.is_healthy:  # a stopped engine answers no question; its error must go out
            async with self._cache_lock:
                packed = await self._packed_cached_blocks()
        return ReplicaReport(
            replica_id=self.replica_id,
            draining=self.draining,
            engine_error="" if self.engine.is_healthy else (self.engine.error or "the engine thread stopped"),
            pid=os.getpid(),
            shard_pids=list(self.engine.engine.executor.shard_pids),
            cached_blocks=packed,
            cpu_cores=list(self.core_claim.cores) if self.core_claim else [],
            cpu_cores_shared=list(self.core_claim.borrowed) if self.core_claim else [],
            report_seq=self._report_seq,
            **fields,
        ).to_dict()

    async def _packed_cached_blocks(self) -> bytes:
        """The prefix cache's short hashes, kept exact by replaying the engine's KV events; taken
        anew from the engine when events fell off its bounded queue unread."""
        engine = self.engine
        if engine.kv_events_lost != self._kv_events_lost_seen:
            hashes, self._kv_events_lost_seen = await engine.cached_block_hashes()
            self._cached_blocks = dict.fromkeys(short_hashes(hashes))
            self._packed = None
        while engine.kv_events:
            event = engine.kv_events.popleft()
            if isinstance(event, BlockStored):
                self._cached_blocks.update(dict.fromkeys(short_hashes(event.block_hashes)))
            elif isinstance(event, BlockRemoved):
                for short in short_hashes(event.block_hashes):
                    self._cached_blocks.pop(short, None)
            elif isinstance(event, AllBlocksCleared):
                self._cached_blocks.clear()
            self._packed = None
        if self._packed is None:
            self._packed = pack_short_hashes(self._cached_blocks)
        return self._packed

    async def record_routing_stats(self) -> dict:
        # A decode replica's prefix cache is not what placement looks at (hand-offs bring the KV).
        return await self.report(include_cache=self.engine.snapshot.get("role") != "decode")

    async def num_blocks_held(self) -> int:
        return await self.engine.call(lambda e: e.num_blocks_held(), timeout_s=10)

    def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise RuntimeError(f"{self.engine.engine.role.value} engine failed: {self.engine.error}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        claim = getattr(self, "core_claim", None)
        if claim is not None:
            claim.release()


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
