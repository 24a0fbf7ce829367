"""What the router's admin endpoint POST /pdserve/scale calls, in the router's process.

A module of its own, importing cluster.app only when a resize runs: the router unpickles the
function it is given at every start, and cluster.app would bring the whole engine (torch) along.
"""

from __future__ import annotations

from typing import Any


def scale(counts: dict[str, int], keyring: Any, model_dir: str) -> dict[str, int]:
    """cluster.app.scale_running_app: ``counts`` applied to the running app, every pool's count back."""
    from cluster import app

    return app.scale_running_app(counts, keyring, model_dir)
