"""The latest replica reports seen by the router's request routers, for ``/pdserve/status``, and
each pool's placement, for the router's estimate of conditional disaggregation.

A separate module on purpose: Serve pickles a request router class by value, module globals
included, so state kept in ``router.serve_routing`` itself would be a private copy.
"""

from __future__ import annotations

import time
from typing import Any

# pool name -> (time of the report, replica id -> report dict)
_LATEST: dict[str, tuple[float, dict[str, dict]]] = {}
# pool name -> its router.pool_placement.PoolPlacement (for the prefill pool's estimate of
# conditional disaggregation); one per pool handle, so per pool in the router's process.
_PLACEMENTS: dict[str, Any] = {}


def record(pool: str, reports: dict[str, dict]) -> None:
    _LATEST[pool] = (time.time(), reports)


def latest_reports() -> dict[str, list[dict]]:
    return {pool: list(reports.values()) for pool, (_, reports) in sorted(_LATEST.items())}


def takes_requests(pool: str) -> bool | None:
    """Whether ``pool`` has a replica neither draining nor failed (its engine stopped), by the
    reports last seen; None before any was seen (then nothing is known against it)."""
    seen = _LATEST.get(pool)
    if seen is None:
        return None
    return any(not r.get("draining") and not r.get("engine_error") for r in seen[1].values())


def register_placement(pool: str, placement: Any) -> None:
    _PLACEMENTS[pool] = placement


def placement(pool: str) -> Any | None:
    """The pool's placement once its handle has routed (or is routing) a first call, else None."""
    return _PLACEMENTS.get(pool)
