"""Ray Serve's declarative entry point: ``import_path: cluster.serve_builder:app``.

A KubeRay RayService (deploy/rayservice.yaml) deploys pdserve through ``serveConfigV2``: Serve's
build task imports this module on the cluster and calls ``app(args)`` with the application's
``args``, which are the cluster config's keys (cluster.example.yaml), nested as in that file:

    serveConfigV2 args ─▶ cluster_config(args) ─▶ ClusterConfig (validated) ─▶ build_app ─▶ Serve app

``pdserve serve`` decides a local cluster's host-dependent settings (``mode: auto``, ``dtype:
auto`` on CPU, the pools' cores, the KV budget, port 0) on the host it runs on. Here the build task
runs on whichever node Serve picks, which says nothing about the nodes the pools land on, so those
settings stay as ``args`` give them, as on a joined cluster (``ray_address``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from cluster import scaling
from cluster.app import build_app
from cluster.cluster_config import ClusterConfig
from common.errors import ConfigError

ARGS_SOURCE = "the serveConfigV2 args"


def cluster_config(args: Mapping[str, object]) -> ClusterConfig:
    """``args`` as a validated ClusterConfig; ConfigError names the bad key."""
    config = ClusterConfig.from_dict(args, source=ARGS_SOURCE)
    if config.device == "cpu" and config.dtype == "auto":
        # The pools exchange KV, so every replica must run one dtype; on CPU "auto" is a speed probe
        # each replica would run for itself, and two nodes near the margin could disagree.
        raise ConfigError(
            f"dtype='auto' with device='cpu' in {ARGS_SOURCE}: every replica would probe its own; "
            "set dtype to float32 (or bfloat16 on CPUs with AMX)"
        )
    return config


def app(args: dict[str, object]):
    """The builder Serve calls (exactly one parameter, as Serve requires): the pdserve application
    for ``args``. API keys come from the build task's environment (PDSERVE_API_KEYS,
    PDSERVE_ADMIN_KEY) or ``api_keys_file``; the model path must resolve to the same directory on
    every node (a model baked into the image, or one volume mounted at one path everywhere)."""
    config = cluster_config(args)
    # Resizes (pdserve scale, POST /pdserve/scale, the SLO planner) go through Serve's external
    # scaling API: the application must set external_scaler_enabled: true (deploy/rayservice.yaml).
    return build_app(config, scaler=functools.partial(scaling.scale_declared, config))
