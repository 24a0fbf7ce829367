"""SLO attainment and the goodput search (bench.slo): pure arithmetic, no server."""

from __future__ import annotations

import pytest

from bench.slo import SLO, RequestTiming, attainment, find_goodput

SLO_1 = SLO(ttft_s=1.0, tpot_s=0.1)


def test_meets_needs_every_limit():
    assert RequestTiming(0.5, 0.05, 2.0, 10).meets(SLO_1)
    assert not RequestTiming(1.5, 0.05, 2.0, 10).meets(SLO_1)  # TTFT miss
    assert not RequestTiming(0.5, 0.2, 2.0, 10).meets(SLO_1)  # TPOT miss
    assert RequestTiming(0.5, None, 0.5, 1).meets(SLO_1)  # one token: no TPOT to miss
    assert not RequestTiming(None, None, None, 0).meets(SLO_1)
    assert not RequestTiming(0.5, 0.05, 3.0, 10).meets(SLO(1.0, 0.1, e2e_s=2.5))


def test_attainment_counts_failures_as_misses():
    timings = [
        RequestTiming(0.5, 0.05, 1.0, 10),
        RequestTiming(0.5, 0.05, 1.0, 10),
        RequestTiming(0.1, 0.01, 0.2, 10, succeeded=False),  # fast but failed: still a miss
        RequestTiming(2.0, 0.05, 3.0, 10),
    ]
    assert attainment(timings, SLO_1) == pytest.approx(0.5)
    assert attainment([], SLO_1) == 0.0


def test_scaled_multiplies_every_limit():
    assert SLO(1.0, 0.1, 4.0).scaled(0.5) == SLO(0.5, 0.05, 2.0)
    assert SLO(1.0, 0.1).scaled(2.0) == SLO(2.0, 0.2, None)


def test_find_goodput_finds_the_threshold():
    goodput, probes = find_goodput(lambda r: 1.0 if r <= 3.7 else 0.5, 0.5, 10.0, tolerance=0.01, max_probes=30)
    assert goodput <= 3.7
    assert goodput == pytest.approx(3.7, rel=0.02)
    assert probes[:2] == [(0.5, 1.0), (10.0, 0.5)]
    assert all(a >= 0.9 for r, a in probes if r <= goodput)


def test_find_goodput_edges():
    assert find_goodput(lambda r: 0.2, 1.0, 8.0) == (0.0, [(1.0, 0.2)])  # even the lowest rate misses
    goodput, probes = find_goodput(lambda r: 1.0, 1.0, 8.0)
    assert goodput == 8.0 and len(probes) == 2  # the highest rate still passes


def test_find_goodput_respects_max_probes():
    _, probes = find_goodput(lambda r: 1.0 if r <= 3.7 else 0.0, 1.0, 100.0, tolerance=1e-9, max_probes=6)
    assert len(probes) == 6
