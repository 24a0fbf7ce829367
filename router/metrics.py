"""The router's request metrics: TTFT, TPOT, end-to-end latency, outcomes.

Recorded through OpenTelemetry (vLLM-style names under ``pdserve:``; exported by whatever
MeterProvider the process installs — none by default, then recording costs next to nothing) and
kept as a bounded window of recent samples for ``/pdserve/status`` and the load client.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque

from opentelemetry import metrics

_WINDOW = 1024  # recent samples kept per series (bounded)


class RouterMetrics:
    def __init__(self, mode: str) -> None:
        meter = metrics.get_meter("pdserve.router")
        self._attrs = {"mode": mode}
        self._ttft = meter.create_histogram("pdserve:time_to_first_token_seconds", unit="s")
        self._tpot = meter.create_histogram("pdserve:time_per_output_token_seconds", unit="s")
        self._e2e = meter.create_histogram("pdserve:e2e_request_latency_seconds", unit="s")
        self._outcomes = meter.create_counter("pdserve:request_outcome_total")
        self.recent: dict[str, deque[float]] = {name: deque(maxlen=_WINDOW) for name in ("ttft", "tpot", "e2e")}
        self.outcomes: Counter[str] = Counter()

    def first_token(self, seconds: float) -> None:
        self._ttft.record(seconds, self._attrs)
        self.recent["ttft"].append(seconds)

    def request_ended(self, outcome: str, started: float, first_token_time: float | None, num_tokens: int) -> None:
        now = time.monotonic()
        self._e2e.record(now - started, self._attrs)
        self.recent["e2e"].append(now - started)
        if first_token_time is not None and num_tokens > 1:
            tpot = (now - first_token_time) / (num_tokens - 1)
            self._tpot.record(tpot, self._attrs)
            self.recent["tpot"].append(tpot)
        self._count(outcome)

    def request_failed(self, status: int) -> None:
        self._count(f"http_{status}")

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self._outcomes.add(1, {**self._attrs, "outcome": outcome})

    def snapshot(self) -> dict:
        medians = {f"{name}_median_s": statistics.median(v) if v else None for name, v in self.recent.items()}
        return {**medians, "outcomes": dict(self.outcomes)}
