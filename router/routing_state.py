"""The latest replica reports seen by the router's request routers, for ``/pdserve/status``, and
each pool's placement, for the router's estimate of conditional disaggregation.

A separate module on purpose: Serve pickles a request router class by value, module globals
included, so state kept in ``router.serve_routing`` itself would be a private copy.
"""

from __future__ import annotations

import time
from typing import Any

# pool name -> (when it was recorded, on this process's monotonic clock; replica id -> report dict)
_LATEST: dict[str, tuple[float, dict[str, dict]]] = {}
# pool name -> its router.pool_placement.PoolPlacement (for the prefill pool's estimate of
# conditional disaggregation); one per pool handle, so per pool in the router's process.
_PLACEMENTS: dict[str, Any] = {}


def record(pool: str, reports: dict[str, dict]) -> None:
    _LATEST[pool] = (time.monotonic(), reports)


def latest_reports() -> dict[str, list[dict]]:
    return {pool: list(reports.values()) for pool, (_, reports) in sorted(_LATEST.items())}


def takes_requests(pool: str) -> bool | None:
    """Whether ``pool`` has a replica neither draining nor failed (its engine stopped), by the
    reports last seen; None before any was seen (then nothing is known against it)."""
    seen = _LATEST.get(pool)
    if seen is None:
        return None
    return any(not r.get("draining") and not r.get("engine_error") for r in seen[1].values())


def takes_requests_within(pool: str, max_age_s: float) -> bool | None:
    """``takes_requests`` by reports recorded in the last ``max_age_s``; None where none is that recent."""
    seen = _LATEST.get(pool)
    if seen is None or time.monotonic() - seen[0] > max_age_s:
        return None
    return takes_requests(pool)


def register_placement(pool: str, placement: Any) -> None:
    _PLACEMENTS[pool] = placement


def placement(pool: str) -> Any | None:
    """The pool's placement once its handle has routed (or is routing) a first call, else None."""
    return _PLACEMENTS.get(pool)
