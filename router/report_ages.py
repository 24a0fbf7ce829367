"""Which replicas stopped answering, by their reports' sequence numbers on the router's own clock.

Serve keeps a replica's last routing stats when the replica stops answering for them: a process
that hangs (stopped, or stuck outside its event loop) looks as it did when it stopped, and would
go on receiving requests until Serve's health checks replace it (~100 s). Each report carries a
count of the reports the replica answered (``report_seq``); a count that has not moved for
``stale_after_s`` of the router's monotonic clock marks the replica failed for placement, health
and the pool-down checks. No two hosts' clocks are compared.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from common.serving import ReplicaReport

STALE_AFTER_S = 10.0  # ten of Serve's routing-stats periods (request_routing_stats_period_s: 1 s)


class ReportAges:
    def __init__(self, stale_after_s: float = STALE_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._seen: dict[str, tuple[int, float]] = {}  # replica id -> (report_seq, when it last changed)

    def mark_silent(self, reports: list[ReplicaReport], every_replica: bool = False) -> list[ReplicaReport]:
        """``reports``, those of replicas silent past the bound carrying an engine error that says
        so. ``every_replica``: the pool's whole list (a replica not in it has left the pool)."""
        now = self.clock()
        marked = []
        for report in reports:
            seen = self._seen.get(report.replica_id)
            if seen is None or seen[0] != report.report_seq:
                self._seen[report.replica_id] = (report.report_seq, now)
            elif now - seen[1] > self.stale_after_s and not report.engine_error:
                silence = f"no report for {now - seen[1]:.0f} s: the replica stopped answering (hung?)"
                report = dataclasses.replace(report, engine_error=silence)
            marked.append(report)
        if every_replica:
            current = {r.replica_id for r in reports}
            for replica_id in [r for r in self._seen if r not in current]:  # replicas gone from the pool
                del self._seen[replica_id]
        return marked
