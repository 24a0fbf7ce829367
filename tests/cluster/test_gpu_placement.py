"""GPU pools through Ray, on fake GPUs: a local Ray started with ``num_gpus=4`` hands out GPU ids
and sets each actor's CUDA_VISIBLE_DEVICES exactly as on a GPU node, so placement is tested here
without one. Each replica and each of its TP shards must get a GPU of its own, and a shard that
finds none free must wait for one instead of doubling up on a GPU another uses.

The pools' engines cannot run without CUDA: the deployments here are probes placed with the pools'
own placement (``cluster.app.replica_placement``) whose shards are started with the launcher's own
actor options (``RayShardLauncher.actor_options``), and report what CUDA_VISIBLE_DEVICES they got."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest
import ray
from ray import serve

from cluster import app
from cluster.cluster_config import ClusterConfig, PlannerConfig, PoolConfig
from cluster.ray_launcher import RayShardLauncher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_GPUS = 4


@ray.remote
class _ShardProbe:
    def visible(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")


@serve.deployment
class _ReplicaProbe:
    """A pool replica's stand-in: shard 0 itself, shards 1.. started as the executor starts them."""

    def __init__(self, tp: int, cpus: float, gpus: float) -> None:
        launcher = RayShardLauncher(cpus, gpus)
        self.shards = [_ShardProbe.options(**launcher.actor_options(rank)).remote() for rank in range(1, tp)]

    async def visible(self) -> list[str | None]:
        shards = await asyncio.gather(*(shard.visible.remote() for shard in self.shards))
        return [os.environ.get("CUDA_VISIBLE_DEVICES"), *shards]


def _probe_app(config: ClusterConfig, pool: str):
    spec = config.pool(pool)
    options = {"name": pool, "num_replicas": spec.replicas, **app.replica_placement(config, pool)}
    return _ReplicaProbe.options(**options).bind(spec.tensor_parallel_size, spec.cpus_per_shard, config.gpus_per_shard)


def _visible(app_name: str, pool: str, replicas: int) -> list[list[str | None]]:
    """Each replica's [its own, its shards'...] CUDA_VISIBLE_DEVICES (replicas found by asking
    until ``replicas`` distinct answers came back: Serve picks the replica of each call)."""
    handle = serve.get_deployment_handle(pool, app_name)
    seen: dict[tuple, list] = {}
    deadline = time.monotonic() + 60
    while len(seen) < replicas and time.monotonic() < deadline:
        answer = handle.visible.remote().result(timeout_s=30)
        seen[tuple(answer)] = answer
    assert len(seen) == replicas, seen
    return list(seen.values())


@pytest.fixture
def fake_gpu_ray():
    ray.init(num_cpus=8, num_gpus=NUM_GPUS, include_dashboard=False)
    serve.start(proxy_location="Disabled")
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def test_every_replica_and_shard_gets_its_own_gpu_and_a_fifth_waits_for_one(fake_gpu_ray):
    config = ClusterConfig(
        device="cuda",
        mode="disagg",
        prefill=PoolConfig(replicas=1, tensor_parallel_size=2),
        decode=PoolConfig(replicas=2, tensor_parallel_size=1),
    )
    assert app.resources_needed(config) == {"CPU": 4.0, "GPU": 4.0}
    serve.run(_probe_app(config, "prefill"), name="prefill-app", route_prefix=None)
    serve.run(_probe_app(config, "decode"), name="decode-app", route_prefix=None)
    (prefill,) = _visible("prefill-app", "prefill", 1)
    decode = _visible("decode-app", "decode", 2)
    gpus = [*prefill, *(g for replica in decode for g in replica)]
    assert sorted(gpus) == [str(i) for i in range(NUM_GPUS)], gpus  # one GPU each, every GPU used once
    assert all(len(g.split(",")) == 1 for g in gpus)  # each sees only its own

    # A fifth shard's replica: every GPU is taken, so it waits (it must not join one in use).
    one_more = dataclasses.replace(config, decode=PoolConfig(replicas=1))
    serve._run(_probe_app(one_more, "decode"), name="fifth", route_prefix=None, _blocking=False)
    time.sleep(5)
    states = dict(serve.status().applications["fifth"].deployments["decode"].replica_states)
    assert states.get("RUNNING", 0) == 0, states
    # Room is made (the prefill pool goes): it starts, on the GPU set free.
    serve.delete("prefill-app")
    deadline = time.monotonic() + 60
    while serve.status().applications["fifth"].status != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    ((fifth,),) = _visible("fifth", "decode", 1)
    assert fifth in prefill and fifth not in {g for replica in decode for g in replica}


def test_on_gpus_the_planners_budget_is_rays_gpu_count(monkeypatch):
    """Ray's GPU count, read as it is in the test above; here handed in (a stand-in for the count,
    not the cluster: starting Ray twice more would cost 20 s of the suite)."""
    config = ClusterConfig(device="cuda", mode="disagg", planner=PlannerConfig(enabled=True))
    pinned = ClusterConfig(device="cuda", mode="disagg", planner=PlannerConfig(enabled=True, budget=2))
    cpu = ClusterConfig(device="cpu", mode="disagg", planner=PlannerConfig(enabled=True))
    # One GPU: fewer than a replica of each pool (an autoscaler has not added GPU nodes yet): no cap.
    for gpus, expected in ((NUM_GPUS, NUM_GPUS), (1, None)):
        monkeypatch.setattr(ray, "cluster_resources", lambda gpus=gpus: {"CPU": 8.0, "GPU": float(gpus)})
        assert app.with_resolved_gpu_budget(config).planner.budget == expected
        assert app.with_resolved_gpu_budget(pinned).planner.budget == 2
        assert app.with_resolved_gpu_budget(cpu).planner.budget is None


def test_a_cpu_pool_asks_ray_for_no_gpu_and_a_cluster_refuses_a_gpu_index():
    from common.errors import ConfigError

    cpu = ClusterConfig(device="cpu", mode="disagg", prefill=PoolConfig(tensor_parallel_size=2))
    placement = app.replica_placement(cpu, "prefill")
    assert placement["ray_actor_options"] == {"num_cpus": 1.0}
    assert placement["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert "num_gpus" not in RayShardLauncher(1.0, cpu.gpus_per_shard).actor_options(1)
    assert not ray.is_initialized()  # asking for the options started no Ray (a later test's would be this one)
    with pytest.raises(ConfigError, match="use device: cuda"):
        ClusterConfig(device="cuda:1")
