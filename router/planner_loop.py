"""The SLO planner at work in the router: every interval, observe both pools, plan, resize, say why.

The router sees what the planner needs: every request's TTFT and TPOT (``SLOWindow``, fed by
``RouterMetrics``) and every replica's latest report (queued prompt tokens, reservations waiting
for KV blocks, KV usage). A resize goes through the same path as ``POST /pdserve/scale`` (one at a
time; Serve adds replicas, or drains the ones that leave). Each decision is logged with its reason
and counted (``pdserve:planner_decisions_total{pool,direction}``), and each pool's target is a
gauge (``pdserve:planner_target_replicas{pool}``), beside the replica counts a dashboard already has.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.metrics import RouterMetrics
from router.planner import POOLS, Decision, Observation, PlannerConfig, PlannerState, SLOWindow, plan, pool_state

logger = logging.getLogger(__name__)


class PlannerLoop:
    @classmethod
    def start(
        cls,
        settings: dict | None,
        both_pools: bool,
        shards_per_replica: dict[str, int],
        resize: Callable[[dict[str, int]], Awaitable[dict[str, int]]],
        metrics: RouterMetrics,
    ) -> PlannerLoop | None:
        """The planner running on the caller's loop, when ``settings`` (PlannerConfig's fields) turn
        it on and the router has both pools and a way to resize them; else None."""
        config = PlannerConfig(**settings) if settings else None
        if config is None or not config.enabled:
            return None
        if not both_pools:
            logger.warning("the SLO planner sizes a prefill and a decode pool; this router has none: it is off")
            return None
        from router.routing_state import latest_reports

        loop = cls(config, shards_per_replica, latest_reports, resize, metrics.registry)
        metrics.slo_window = loop.window
        loop.task = asyncio.get_running_loop().create_task(loop.run())
        logger.info("SLO planner on: %s", config)
        return loop

    def __init__(
        self,
        config: PlannerConfig,
        shards_per_replica: dict[str, int],
        reports: Callable[[], dict[str, list[dict]]],
        resize: Callable[[dict[str, int]], Awaitable[dict[str, int]]],
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.task: asyncio.Task | None = None  # run() on the router's loop, once started
        self.shards_per_replica = shards_per_replica
        self.reports = reports
        self.resize = resize
        self.clock = clock
        self.window = SLOWindow(config.ttft_slo_s, config.tpot_slo_s)
        self.state = PlannerState()
        self.last: dict[str, Decision] = {}
        self._last_tick = clock()
        self._target = Gauge(
            "pdserve:planner_target_replicas",
            "The SLO planner's replica count for each pool.",
            ("pool",),
            registry=registry,
        )
        self._decisions = Counter(
            "pdserve:planner_decisions",
            "The SLO planner's resizes that Serve ran, by pool and direction.",
            ("pool", "direction"),
            registry=registry,
        )

    async def tick(self) -> dict[str, Decision] | None:
        """One interval: the decisions (None while a pool has not reported yet)."""
        reports = self.reports()
        if not all(reports.get(pool) for pool in POOLS):
            return None
        now = self.clock()
        ttft, tpot, prompt_tokens = self.window.take(self.config.min_samples)
        elapsed, self._last_tick = now - self._last_tick, now
        pools = {pool: pool_state(reports[pool], self.shards_per_replica.get(pool, 1)) for pool in POOLS}
        if elapsed > 0:
            pools["prefill"] = replace(pools["prefill"], prompt_tokens_per_s=prompt_tokens / elapsed)
        decisions = plan(Observation(now, ttft, tpot, pools), self.config, self.state)
        changes = {pool: d.target for pool, d in decisions.items() if d.direction != "hold"}
        for decision in decisions.values():
            self._target.labels(decision.pool).set(decision.target)
            if decision.direction != "hold":
                logger.info(
                    "planner: %s %d -> %d: %s", decision.pool, decision.current, decision.target, decision.reason
                )
        self.last = decisions
        if changes:
            try:
                await self.resize(changes)
            except Exception as exc:  # the next interval sees the counts that are, and decides again
                logger.warning("planner: the resize to %s failed: %s", changes, exc)
            else:
                for decision in decisions.values():
                    if decision.direction != "hold":
                        self._decisions.labels(decision.pool, decision.direction).inc()
        return decisions

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.tick()
            except Exception:  # a bad report must not end the loop
                logger.exception("planner: an interval failed")

    def status(self) -> dict:
        return {pool: {"current": d.current, "target": d.target, "reason": d.reason} for pool, d in self.last.items()}
