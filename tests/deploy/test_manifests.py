"""deploy/: every manifest against KubeRay's RayService schema, and what a schema cannot say.

No Kubernetes cluster runs here: these check the manifests as the API server would admit them
(schema, unknown fields) and as pdserve needs them (groups, GPUs, pinning, probes, metrics).
"""

from __future__ import annotations

import copy
import inspect
import ipaddress
from collections.abc import Callable
from typing import Any

import pytest

from cluster.cluster_config import ClusterConfig
from common import env
from tests.deploy.manifests import (
    GPU,
    POOL_GROUPS,
    Document,
    documents,
    groups,
    offered_resources,
    pdserve_app,
    port_number,
    ray_container,
    rayservice,
    schema_errors,
    serve_config,
    services,
)

ROUTER_GROUP = "router"


@pytest.fixture(scope="module")
def service() -> dict[str, Any]:
    return rayservice()


@pytest.fixture(scope="module")
def config(service: dict[str, Any]) -> ClusterConfig:
    from cluster.serve_builder import cluster_config

    return cluster_config(pdserve_app(service)["args"])


# --- the schema ------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", documents(), ids=lambda d: d.name)
def test_every_manifest_passes_its_schema(doc: Document) -> None:
    assert schema_errors(doc.body) == []


def test_deploy_holds_one_rayservice_and_the_router_service() -> None:
    assert rayservice()["metadata"]["name"]
    assert len(services()) == 1


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """A breakage: the field at dotted ``path`` (list indices as numbers) set to ``value``, or
    deleted where ``value`` is _DELETE; a last key that is not there yet is added."""

    def apply(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = body
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return apply


_DELETE = object()
_WORKER = "spec.rayClusterConfig.workerGroupSpecs.0"
_CONTAINER = f"{_WORKER}.template.spec.containers.0"
BROKEN = {
    "replicas as a word": (_set(f"{_WORKER}.replicas", "one"), "'one' is not of type 'integer'"),
    "a worker group without its name": (_set(f"{_WORKER}.groupName", _DELETE), "'groupName' is a required property"),
    "rayStartParams misspelled": (_set(f"{_WORKER}.rayStartParam", {"num-cpus": "1"}), "rayStartParam"),
    "a CPU limit that is no quantity": (_set(f"{_CONTAINER}.resources.limits.cpu", "lots"), "'lots'"),
    "a container without its name": (_set(f"{_CONTAINER}.name", _DELETE), "'name' is a required property"),
    "serveConfigV2 as a mapping": (_set("spec.serveConfigV2", {"applications": []}), "is not of type 'string'"),
    "no name": (_set("metadata.name", _DELETE), "metadata.name: required"),
}


@pytest.mark.parametrize("breakage", BROKEN.values(), ids=list(BROKEN))
def test_the_schema_refuses_a_broken_rayservice(
    service: dict[str, Any], breakage: tuple[Callable[[dict[str, Any]], None], str]
) -> None:
    """The same validator as above fails on each breakage, naming it: the check can fail."""
    broken = copy.deepcopy(service)
    apply, expected = breakage
    apply(broken)
    errors = schema_errors(broken)
    assert any(expected in error for error in errors), errors


def test_the_schema_refuses_a_broken_service() -> None:
    broken = copy.deepcopy(services()[0])
    broken["spec"]["ports"][0]["port"] = "eight thousand"
    del broken["spec"]["ports"][0]["name"]
    broken["spec"]["selectr"] = {}
    errors = schema_errors(broken)
    assert any("'eight thousand' is not of type 'integer'" in e for e in errors), errors
    assert any("selectr" in e for e in errors), errors


def test_a_manifest_of_an_unknown_kind_has_no_schema() -> None:
    with pytest.raises(ValueError, match="no schema"):
        schema_errors({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}})


# --- what the schema cannot say ------------------------------------------------------------------


def test_head_router_and_pool_groups_each_ask_for_their_resources(service: dict[str, Any]) -> None:
    found = groups(service)
    assert {"head", ROUTER_GROUP, *POOL_GROUPS} <= set(found)
    for name, group in found.items():
        resources = ray_container(group).get("resources") or {}
        for side in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources.get(side) or {}), f"{name}: {side} needs cpu and memory"


def test_each_pool_shard_has_a_gpu_by_the_device_plugin_convention(
    service: dict[str, Any], config: ClusterConfig
) -> None:
    """A GPU in limits (requests, if they name it, must equal them); one per shard a pod hosts;
    none where no pool runs."""
    for name, group in groups(service).items():
        resources = ray_container(group)["resources"]
        limit = resources["limits"].get(GPU)
        if GPU in resources["requests"]:
            assert resources["requests"][GPU] == limit, f"{name}: extended resources need requests == limits"
        if name not in POOL_GROUPS:
            assert limit is None, f"{name} runs no pool shard: no GPU"
            continue
        assert isinstance(limit, int) and limit >= 1, f"{name}: {GPU} limit {limit!r}"
        assert limit == _shards_per_pod(group, config, name), f"{name}: one GPU per shard its pod hosts"


def _pool_resource(config: ClusterConfig, pool: str) -> tuple[str, float]:
    asked = config.pool(pool).ray_resources or {}
    assert len(asked) == 1, f"{pool}: ray_resources should name the one resource its group offers, got {asked}"
    ((name, amount),) = asked.items()
    return name, amount


def _shards_per_pod(group: dict[str, Any], config: ClusterConfig, pool: str) -> int:
    name, amount = _pool_resource(config, pool)
    return int(offered_resources(group).get(name, 0.0) // amount)


def test_each_pool_runs_only_on_its_group_with_room_for_its_replicas(
    service: dict[str, Any], config: ClusterConfig
) -> None:
    found = groups(service)
    for pool in POOL_GROUPS:
        name, _ = _pool_resource(config, pool)
        offering = [group for group, spec in found.items() if name in offered_resources(spec)]
        assert offering == [pool], f"{pool}'s resource {name} is offered by {offering}"
        spec = config.pool(pool)
        shards = _shards_per_pod(found[pool], config, pool)
        # A replica's shards share one placement group packed on one node (STRICT_PACK).
        assert shards >= spec.tensor_parallel_size, f"{pool}: a pod holds {shards} shards, a replica needs {spec}"
        room = found[pool]["replicas"] * (shards // spec.tensor_parallel_size)
        assert room >= spec.replicas, f"{pool}: {spec.replicas} replicas, room for {room}"
        assert found[pool]["minReplicas"] <= found[pool]["replicas"] <= found[pool]["maxReplicas"]


def test_the_router_is_pinned_to_its_group(service: dict[str, Any]) -> None:
    (override,) = [d for d in pdserve_app(service).get("deployments") or [] if d["name"] == "router"]
    asked = override["ray_actor_options"]["resources"]
    found = groups(service)
    for name, amount in asked.items():
        offering = [group for group, spec in found.items() if name in offered_resources(spec)]
        assert offering == [ROUTER_GROUP], f"the router's {name} is offered by {offering}"
        assert amount <= offered_resources(found[ROUTER_GROUP])[name]


def test_serve_config_is_one_serve_accepts(service: dict[str, Any]) -> None:
    from ray.serve.schema import ServeDeploySchema

    parsed = ServeDeploySchema.model_validate(serve_config(service))
    # The router serves HTTP itself; Serve's proxy would want the same port.
    assert parsed.proxy_location == "Disabled"
    assert [app.name for app in parsed.applications] == ["pdserve"]


def test_the_router_is_ready_on_health_on_its_serving_port(service: dict[str, Any], config: ClusterConfig) -> None:
    import router.server

    # The router's own routes (router/server.py), on config.port.
    assert 'add_api_route("/health"' in inspect.getsource(router.server)
    container = ray_container(groups(service)[ROUTER_GROUP])
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health"
    assert port_number(container, probe["port"]) == config.port
    assert not ipaddress.ip_address(config.host).is_loopback, "other pods reach the router at its pod IP"


def test_no_other_pod_waits_on_the_app_or_on_serves_proxy(service: dict[str, Any], config: ClusterConfig) -> None:
    """The head's readiness gates KubeRay's submission of serveConfigV2, so it cannot wait on the
    app; a worker without a probe of its own gets KubeRay's, which asks Serve's (disabled) proxy."""
    for name, group in groups(service).items():
        if name == ROUTER_GROUP:
            continue
        container = ray_container(group)
        probe = container.get("readinessProbe")
        if name == "head":
            assert probe is None or probe.get("httpGet", {}).get("path") != "/health"
        else:
            assert probe is not None, f"{name}: a readinessProbe of its own"
            assert port_number(container, probe["httpGet"]["port"]) != config.port


def test_every_pod_is_scraped_by_prometheus(service: dict[str, Any], config: ClusterConfig) -> None:
    import router.server

    assert 'add_api_route("/metrics"' in inspect.getsource(router.server)
    for name, group in groups(service).items():
        annotations = group["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/path"] == "/metrics", name
        port = int(annotations["prometheus.io/port"])
        if name == ROUTER_GROUP:
            assert port == config.port, "pdserve's metrics are on the router's API port"
        else:  # Ray's own metrics, where the group tells Ray to export them
            assert group["rayStartParams"]["metrics-export-port"] == str(port), name


def test_every_ray_process_gets_the_serve_environment_and_the_api_keys(config: ClusterConfig) -> None:
    """What `pdserve serve` sets for a local Ray (common.env.SERVE_PROCESS_ENV) and, since the
    router listens beyond loopback, API keys from a Secret: Serve's build task loads them."""
    for name, container in _all_containers():
        values = {e["name"]: e for e in container.get("env") or []}
        for key, value in env.SERVE_PROCESS_ENV.items():
            assert values.get(key, {}).get("value") == value, f"{name}: {key}={value}"
        assert "secretKeyRef" in values["PDSERVE_API_KEYS"]["valueFrom"], name


def _all_containers() -> list[tuple[str, dict[str, Any]]]:
    return [(name, c) for name, group in groups(rayservice()).items() for c in group["template"]["spec"]["containers"]]


def test_the_service_reaches_only_the_router(service: dict[str, Any], config: ClusterConfig) -> None:
    (svc,) = services()
    selector = svc["spec"]["selector"]
    for name, group in groups(service).items():
        labels = group["template"]["metadata"].get("labels") or {}
        selected = all(labels.get(key) == value for key, value in selector.items())
        assert selected == (name == ROUTER_GROUP), f"the Service {'selects' if selected else 'misses'} {name}"
    container = ray_container(groups(service)[ROUTER_GROUP])
    (port,) = svc["spec"]["ports"]
    assert port_number(container, port["targetPort"]) == config.port
