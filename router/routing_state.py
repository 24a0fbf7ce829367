"""The latest replica reports seen by the router's request routers, for ``/pdserve/status``.

A separate module on purpose: Serve pickles a request router class by value, module globals
included, so state kept in ``router.serve_routing`` itself would be a private copy.
"""

from __future__ import annotations

import time

# pool name -> (time of the report, replica id -> report dict)
_LATEST: dict[str, tuple[float, dict[str, dict]]] = {}


def record(pool: str, reports: dict[str, dict]) -> None:
    _LATEST[pool] = (time.time(), reports)


def latest_reports() -> dict[str, list[dict]]:
    return {pool: list(reports.values()) for pool, (_, reports) in sorted(_LATEST.items())}
