"""SLOs, per-request timings, SLO attainment and goodput (DistServe, OSDI 2024).

Goodput is the highest request rate at which at least ``target`` (90%) of requests meet both their
TTFT and TPOT SLOs (and the E2E one, when given). Per-GPU goodput divides it by the GPUs used.
The same definitions serve the load client (measured timings) and the simulator (predicted ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    e2e_s: float | None = None

    def scaled(self, factor: float) -> SLO:
        """Every limit multiplied by ``factor`` (< 1 tightens): the SLO-scale sweep."""
        return SLO(self.ttft_s * factor, self.tpot_s * factor, None if self.e2e_s is None else self.e2e_s * factor)


@dataclass(frozen=True)
class RequestTiming:
    """One request as a client saw it (or the simulator predicts it). ``tpot_s`` is None for one token."""

    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    num_output_tokens: int
    succeeded: bool = True

    def meets(self, slo: SLO) -> bool:
        if not self.succeeded or self.ttft_s is None or self.ttft_s > slo.ttft_s:
            return False
        if self.tpot_s is not None and self.tpot_s > slo.tpot_s:
            return False
        return slo.e2e_s is None or (self.e2e_s is not None and self.e2e_s <= slo.e2e_s)


def attainment(timings: Sequence[RequestTiming], slo: SLO) -> float:
    """Share of requests (failed ones included, as misses) that meet every limit of ``slo``."""
    if not timings:
        return 0.0
    return sum(t.meets(slo) for t in timings) / len(timings)


def find_goodput(
    attainment_at: Callable[[float], float],
    low_rate: float,
    high_rate: float,
    target: float = 0.9,
    tolerance: float = 0.05,
    max_probes: int = 12,
) -> tuple[float, list[tuple[float, float]]]:
    """Highest rate whose attainment is >= ``target``, by bisection (attainment falls as rate rises).

    Returns (goodput, every (rate, attainment) probed). ``tolerance`` is relative to the rate.
    Goodput is 0.0 when even ``low_rate`` misses the target; ``high_rate`` when it still meets it.
    """
    probes: list[tuple[float, float]] = []

    def probe(rate: float) -> bool:
        value = attainment_at(rate)
        probes.append((rate, value))
        return value >= target

    if not probe(low_rate):
        return 0.0, probes
    if probe(high_rate):
        return high_rate, probes
    good, bad = low_rate, high_rate
    while len(probes) < max_probes and (bad - good) > tolerance * good:
        middle = (good + bad) / 2
        if probe(middle):
            good = middle
        else:
            bad = middle
    return good, probes
