"""What the router's admin endpoint POST /pdserve/scale (and the SLO planner) calls, in the router's process.

``scale`` resizes an app ``pdserve serve`` deployed (it redeploys the config it recorded);
``scale_declared`` one deployed from a declarative config (a RayService), through Serve's
external scaling API, leaving the config the operator owns as it is.

A module of its own, importing cluster.app only when a resize runs: the router unpickles the
function it is given at every start, and cluster.app would bring the whole engine (torch) along.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.cluster_config import ClusterConfig


def scale(counts: dict[str, int], keyring: Any, model_dir: str) -> dict[str, int]:
    """cluster.app.scale_running_app: ``counts`` applied to the running app, every pool's count back."""
    from cluster import app

    return app.scale_running_app(counts, keyring, model_dir)


def scale_declared(declared: ClusterConfig, counts: dict[str, int], keyring: Any, model_dir: str) -> dict[str, int]:
    """cluster.app.scale_declared_app: ``counts`` set on the declared app, every pool's count back
    (bound with ``functools.partial`` to the config the app was declared with)."""
    from cluster import app

    return app.scale_declared_app(declared, counts)
