"""bench.router_overhead end to end: a real local Ray + Serve, the real RouterServer on null pools.

Both paths (router and bypass) must serve every request with exactly max_tokens text chunks, and the
JSON must hold what the table shows. Timings are checked for shape only (this host is shared).
"""

from __future__ import annotations

import json

import pytest
import ray

import bench.common
from bench import router_overhead
from router.report_ages import STALE_AFTER_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
NUM_REQUESTS, MAX_TOKENS = 30, 4


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)  # keep bench/results/ for real runs
    return tmp_path


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_router_overhead_runs_both_paths(results_dir, mode):
    # The run outlasts the router's staleness bound: null pools whose reports stopped changing would
    # be taken for hung replicas there, and every later request refused (as they were until 2026-12-07).
    rate = NUM_REQUESTS / (STALE_AFTER_S + 2)
    argv = ["--num-requests", str(NUM_REQUESTS), "--rate", f"{rate:g}", "--max-tokens", str(MAX_TOKENS)]
    argv += ["--warmup", "3", "--arrival", "constant"]
    payload = router_overhead.main([*argv, "--mode", mode])
    # The benchmark owns its Ray: nothing is left for a later test's cluster to collide with.
    assert not ray.is_initialized()

    written = json.loads((results_dir / "router_overhead.json").read_text())
    assert written["benchmark"] == "router_overhead"
    assert set(written) >= {"config", "router_added_ms", "paths"}
    assert written["config"]["mode"] == mode and written["config"]["max_tokens"] == MAX_TOKENS
    assert set(written["paths"]) == set(router_overhead.PATHS) == set(payload["paths"])

    for path, result in written["paths"].items():
        requests, summary = result["requests"], result["summary"]
        assert len(requests) == NUM_REQUESTS, path
        assert all(r["error"] is None for r in requests), [r["error"] for r in requests if r["error"]]
        assert summary["completed"] == NUM_REQUESTS and summary["failed"] == 0
        for r in requests:
            assert len(r["itl_s"]) + 1 == MAX_TOKENS, f"{path}: {len(r['itl_s']) + 1} text chunks"
            assert r["num_output_tokens"] == MAX_TOKENS  # the usage chunk's count agrees
            assert 0 < r["ttft_s"] <= r["e2e_s"]
        for metric in ("ttft", "e2e"):
            p50, p90, p99 = (summary[f"{s}_{metric}_s"] for s in ("p50", "p90", "p99"))
            assert 0 < p50 <= p90 <= p99, (path, metric, p50, p90, p99)

    added = written["router_added_ms"]
    assert set(added) == {f"{m} {s}" for m in ("ttft", "e2e") for s in ("p50", "p90", "p99")} | {"itl mean"}
    assert all(isinstance(v, float) for v in added.values())
