"""Hosts a replica's TP shards 1..N-1 as Ray actors in the replica's placement group.

The Serve replica itself is rank 0 (it drives the steps) and sits in bundle 0; shard ``r`` is an
actor pinned to bundle ``r`` of the same STRICT_PACK group, so a replica's shards share a host
and their rendezvous store on 127.0.0.1 is reachable.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.logs import setup_logging
from engine.executor import WorkerHandle, WorkerLauncher, run_worker


@ray.remote(max_restarts=0)
class ShardActor:
    def run(self, rank: int, world_size: int, init_method: str, config: dict, model_dir: str) -> None:
        setup_logging()
        run_worker(rank, world_size, init_method, config, model_dir)

    def pid(self) -> int:
        import os

        return os.getpid()


class RayShardHandle(WorkerHandle):
    def __init__(self, actor, run_ref) -> None:
        self.actor = actor
        self.run_ref = run_ref

    def is_alive(self) -> bool:
        done, _ = ray.wait([self.run_ref], timeout=0)
        return not done

    def join(self, timeout_s: float) -> None:
        ray.wait([self.run_ref], timeout=max(timeout_s, 0))
        ray.kill(self.actor, no_restart=True)


class RayShardLauncher(WorkerLauncher):
    """``cpus_per_shard`` and ``gpus_per_shard`` must match the placement group's bundles (see
    cluster.app). With a GPU per shard, Ray gives each shard actor its own GPU and sets its
    CUDA_VISIBLE_DEVICES to it: every shard sees one GPU, as cuda:0."""

    def __init__(self, cpus_per_shard: float = 1.0, gpus_per_shard: float = 0.0) -> None:
        self.cpus_per_shard = cpus_per_shard
        self.gpus_per_shard = gpus_per_shard

    @property
    def assigns_devices(self) -> bool:
        return bool(self.gpus_per_shard)

    def __repr__(self) -> str:  # part of the deployment version (cluster.app): must be stable
        return f"RayShardLauncher(cpus_per_shard={self.cpus_per_shard}, gpus_per_shard={self.gpus_per_shard})"

    def actor_options(self, rank: int) -> dict:
        """Shard ``rank``'s actor options: its resources, in bundle ``rank`` of the replica's group."""
        options: dict = {"num_cpus": self.cpus_per_shard, "name": None}
        if self.gpus_per_shard:
            options["num_gpus"] = self.gpus_per_shard
        # Asked outside Ray (no placement group), get_current_placement_group would start one.
        group = get_current_placement_group() if ray.is_initialized() else None
        if group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=rank
            )
        return options

    def launch(self, rank, world_size, init_method, config, model_dir) -> WorkerHandle:
        actor = ShardActor.options(**self.actor_options(rank)).remote()
        return RayShardHandle(actor, actor.run.remote(rank, world_size, init_method, config, model_dir))
