"""A declared app (the RayService's serveConfigV2, deployed as KubeRay deploys it: the config
handed to Serve's controller) is resized in place through Serve's external scaling API, by the
router's admin endpoint that `pdserve scale` and the SLO planner use; the config stays as applied."""

from __future__ import annotations

import copy
import time

import pytest
from ray import serve

from bench.server_process import free_port
from cluster import app
from cluster.serve_builder import cluster_config
from tests.cluster.serving import get_json, post
from tests.deploy.manifests import rayservice, serve_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# The manifest's own application, its args sized for this CPU host (device, dtype, KV budget, port)
# and its deployment overrides dropped (they pin replicas to the pods' custom resources).
CPU_ARGS = {
    "mode": "disagg",
    "device": "cpu",
    "dtype": "float32",
    "kv_cache_memory": 32 * 2**20,
    "transport": "tcp",
    "host": "127.0.0.1",
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
}


def _declared_config(port: int) -> dict:
    config = copy.deepcopy(serve_config(rayservice()))
    (application,) = config["applications"]
    application["args"] = {**CPU_ARGS, "port": port}
    application["deployments"] = []
    return config


def _running(pool: str) -> dict[str, int]:
    return dict(serve.status().applications[app.APP_NAME].deployments[pool].replica_states)


@pytest.fixture(scope="module")
def declared():
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    port = free_port()
    config = _declared_config(port)
    app.start_ray(cluster_config(config["applications"][0]["args"]))
    app.start_serve(cluster_config(config["applications"][0]["args"]))
    try:
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
        app.wait_ready(300)
        yield f"http://127.0.0.1:{port}", config
    finally:
        app.shutdown()


def test_a_declared_app_is_resized_in_place_and_its_config_is_left_as_applied(declared):
    url, config = declared
    assert get_json(url + "/health")["status"] == "ok"
    code, _, answer = post(url + "/pdserve/scale", {"prefill": 2}, timeout=600)
    assert code == 200 and answer["replicas"] == {"prefill": 2, "decode": 1}, answer
    assert _running("prefill") == {"RUNNING": 2} and _running("decode") == {"RUNNING": 1}
    assert len(get_json(url + "/pdserve/status")["pools"]["prefill"]) == 2
    # KubeRay applies the same config again (its reconcile loop, a restarted operator): the size stays.
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
    time.sleep(3)  # several of Serve's control loops
    assert _running("prefill") == {"RUNNING": 2}
    code, _, answer = post(
        url + "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4}
    )
    assert code == 200 and answer["choices"][0]["text"], answer
    # Back down: the replica leaving is drained; the config Serve holds is still the declared one.
    code, _, answer = post(url + "/pdserve/scale", {"prefill": 1}, timeout=600)
    assert code == 200 and answer["replicas"] == {"prefill": 1, "decode": 1}, answer
    assert _running("prefill") == {"RUNNING": 1}
    applied = serve.status().applications[app.APP_NAME]
    assert applied.status == "RUNNING"
    details = serve.context._get_global_client().get_serve_details()
    args = details["applications"][app.APP_NAME]["deployed_app_config"]["args"]
    assert args["prefill"] == {"replicas": 1} and args == config["applications"][0]["args"]


def test_a_resize_the_cluster_cannot_place_is_refused_with_its_reason(declared):
    url, _ = declared
    code, _, answer = post(url + "/pdserve/scale", {"decode": 500}, timeout=120)
    assert code == 400 and "CPU" in answer["error"]["message"], answer
    assert _running("decode") == {"RUNNING": 1}


def test_a_declared_app_without_the_external_scaler_is_refused_with_what_to_set(declared):
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    url, config = declared
    without = copy.deepcopy(config)
    without["applications"][0]["external_scaler_enabled"] = False
    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate(without))
    deadline = time.monotonic() + 120
    while client.get_serve_details()["applications"][app.APP_NAME]["external_scaler_enabled"]:
        assert time.monotonic() < deadline, "Serve did not take the new config"
        time.sleep(0.5)
    app.wait_ready(300)
    code, _, answer = post(url + "/pdserve/scale", {"prefill": 2}, timeout=120)
    assert code == 400 and "external_scaler_enabled: true" in answer["error"]["message"], answer
    assert _running("prefill") == {"RUNNING": 1}
