"""``/health``: answered from the replica reports the router already has, a pool call only where
they are missing or old, and then one call shared by every caller for a few seconds.

A load balancer or a Kubernetes probe may poll ``/health`` often, and so may anyone who reaches
the port: each answer must cost the pools nothing new. A pool's state comes from the reports its
request router last recorded (router.routing_state; replicas silent too long already carry an
error, router.report_ages). Where no report is younger than ``max_report_age_s`` (an idle router
routes nothing, so it may have none), one ``report`` call per pool is made and its outcome kept
``probe_ttl_s``; callers meanwhile share the call in flight.

Readiness: 200 "ok"; 200 "degraded" while the prefill pool has no working replica (prompts are
computed on decode replicas); 503 only when nothing can serve (the pool that streams tokens is
down or does not answer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

MAX_REPORT_AGE_S = 15.0
PROBE_TTL_S = 2.0


@dataclass
class _Probe:
    at: float = float("-inf")
    error: str | None = None
    call: asyncio.Future | None = None


class HealthCheck:
    @classmethod
    def for_pools(cls, decode: Any, prefill: Any | None, call_timeout_s: float) -> HealthCheck:
        """The router's: its pools by role, their reports from router.routing_state, a pool's own
        ``report`` call (bounded by ``call_timeout_s``) where those are missing or old."""
        from router.routing_state import takes_requests_within

        async def ask(handle: Any) -> Any:
            return await asyncio.wait_for(_awaited(handle.report.remote()), call_timeout_s)

        pools = {"colocated": decode} if prefill is None else {"prefill": prefill, "decode": decode}
        return cls(pools, takes_requests_within, ask)

    def __init__(
        self,
        pools: dict[str, Any],
        takes_requests: Callable[[str, float], bool | None],
        ask: Callable[[Any], Awaitable[Any]],
        max_report_age_s: float = MAX_REPORT_AGE_S,
        probe_ttl_s: float = PROBE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``pools``: role -> handle ("prefill", and "decode" or "colocated"); ``takes_requests(role,
        max_age_s)``: the reports' verdict, None where none is that recent; ``ask(handle)``: a
        bounded call to the pool (raises on failure or timeout)."""
        self.pools = pools
        self.takes_requests = takes_requests
        self.ask = ask
        self.max_report_age_s = max_report_age_s
        self.probe_ttl_s = probe_ttl_s
        self.clock = clock
        self._probes = {role: _Probe() for role in pools}
        self.num_pool_calls = 0

    async def verdict(self) -> tuple[int, dict]:
        down, degraded = [], []
        for role in self.pools:
            problem = await self._problem(role)
            if problem is not None:
                (degraded if role == "prefill" else down).append(f"{_name(role)}: {problem}")
        if down:
            return 503, {"status": "unavailable", "pools_down": down}
        if degraded:
            return 200, {"status": "degraded", "pools_degraded": degraded}
        return 200, {"status": "ok"}

    async def _problem(self, role: str) -> str | None:
        verdict = self.takes_requests(role, self.max_report_age_s)
        if verdict is not None:
            return None if verdict else "no working replica"
        return await self._probe(role)

    async def _probe(self, role: str) -> str | None:
        probe = self._probes[role]
        if self.clock() - probe.at <= self.probe_ttl_s:
            return probe.error
        if probe.call is None or probe.call.done():  # else share the call in flight
            probe.call = asyncio.ensure_future(self._call(role))
        return await asyncio.shield(probe.call)

    async def _call(self, role: str) -> str | None:
        self.num_pool_calls += 1
        probe = self._probes[role]
        try:
            await self.ask(self.pools[role])
            error = None
        except Exception as exc:
            error = type(exc).__name__
        probe.at, probe.error = self.clock(), error
        return error


async def _awaited(response: Any) -> Any:
    return await response


def _name(role: str) -> str:
    return "decode" if role == "colocated" else role
