"""cluster.serve_builder, as the RayService's serveConfigV2 names it: the import path resolves, its
args make a valid ClusterConfig, and the builder returns the app Serve would deploy. Neither Ray
nor a model is started: the default model's converted directory is stood in for by a stub."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from types import FunctionType
from typing import Any

import pytest

from common.errors import ConfigError
from tests.deploy.manifests import pdserve_app, rayservice


@pytest.fixture(scope="module")
def manifest_app() -> dict[str, Any]:
    return pdserve_app(rayservice())


def _builder(import_path: str) -> Any:
    module, _, attr = import_path.partition(":")  # Serve's form: module:attribute
    return getattr(importlib.import_module(module), attr)


def test_the_import_path_resolves_to_a_builder_serve_can_call(manifest_app: dict[str, Any]) -> None:
    builder = _builder(manifest_app["import_path"])
    # Serve calls a builder function with the args dict as its only parameter.
    assert isinstance(builder, FunctionType)
    assert len(inspect.signature(builder).parameters) == 1


def test_the_manifests_args_are_a_valid_cluster_config(manifest_app: dict[str, Any]) -> None:
    from cluster.serve_builder import cluster_config

    config = cluster_config(manifest_app["args"])
    assert config.disaggregated
    # Pods: KV crosses the pod network (they share no files: no shm between them).
    assert config.transport in ("tcp", "grpc", "torch")
    assert config.kv_host == "node"
    assert config.port != 0, "the probes and the Service name a fixed port"


@pytest.fixture
def stub_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A converted default model where the cache says one is (as the image bakes it), so that
    build_app finds it and converts nothing."""
    from engine.model_loader import DEFAULT_MODEL_NAME

    model_dir = tmp_path / "models" / DEFAULT_MODEL_NAME
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    return model_dir


def test_the_builder_returns_the_app_whose_deployments_the_config_overrides(
    manifest_app: dict[str, Any], stub_default_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray.serve import Application
    from ray.serve._private.build_app import build_app as serve_build  # what Serve's build task runs

    monkeypatch.setenv("PDSERVE_API_KEYS", "sk-test-key-0123")  # the Secret, in the pods
    app = _builder(manifest_app["import_path"])(manifest_app["args"])
    assert isinstance(app, Application)
    built = {d.name: d for d in serve_build(app, name=manifest_app["name"]).deployments}
    assert {"router", "prefill", "decode"} <= set(built)
    for override in manifest_app.get("deployments") or []:
        assert override["name"] in built, f"serveConfigV2 overrides {override['name']}, which the app lacks"
        # A config's ray_actor_options replace the code's whole: it must keep what the code sets.
        code = built[override["name"]].ray_actor_options or {}
        kept = {key: override.get("ray_actor_options", {}).get(key) for key in code}
        assert kept == code, f"{override['name']}: the override drops or changes {code}"
    # Resizes go through Serve's external scaling API, which the application must turn on.
    assert manifest_app.get("external_scaler_enabled") is True


def test_the_builder_refuses_args_that_cannot_work() -> None:
    from cluster.serve_builder import cluster_config

    with pytest.raises(ConfigError, match=r"prefill\.replica"):
        cluster_config({"prefill": {"replica": 2}})
    with pytest.raises(ConfigError, match="dtype"):
        cluster_config({"device": "cpu", "dtype": "auto"})
    with pytest.raises(ConfigError, match="kv_advertise_host"):
        cluster_config({"transport": "tcp", "kv_host": "0.0.0.0"})
    # The planner resizes a declared app through Serve's external scaling API: allowed.
    assert cluster_config({"mode": "disagg", "planner": {"enabled": True}}).planner.enabled
