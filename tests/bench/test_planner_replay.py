"""The planner replay's trace: phases of their own rate and burstiness, in order."""

from __future__ import annotations

import numpy as np
import pytest

from bench.planner_replay import build_trace, parse_phases


def test_phases_parse_and_bad_ones_are_refused():
    assert parse_phases("0.5:40,3:30:4") == [(0.5, 40.0, 1.0), (3.0, 30.0, 4.0)]
    for bad in ("0.5", "0:10", "1:0", "a:b"):
        with pytest.raises((SystemExit, ValueError)):
            parse_phases(bad)


def test_each_phase_keeps_its_rate_and_the_bursty_one_its_burstiness():
    trace = build_trace(parse_phases("1:400,8:400:4"), 256, 32, seed=0)
    arrivals = np.array([r.arrival_s for r in trace])
    assert np.all(np.diff(arrivals) >= 0) and arrivals[-1] < 800
    quiet, burst = arrivals[arrivals < 400], arrivals[arrivals >= 400]
    assert 0.8 < len(quiet) / 400 < 1.2 and 6.5 < len(burst) / 400 < 9.5
    # Gamma gaps at burstiness 4: their squared coefficient of variation is 1/shape = 4 (Poisson: 1).
    cv2 = lambda gaps: gaps.var() / gaps.mean() ** 2  # noqa: E731
    assert cv2(np.diff(quiet)) < 1.6 and cv2(np.diff(burst)) > 2.5
    assert {(r.num_prompt_tokens, r.num_output_tokens) for r in trace} == {(256, 32)}
