"""One short real sweep: `bench.goodput` starts a local cluster, loads it, and writes the JSON and PNGs."""

from __future__ import annotations

import json

import pytest

from bench import goodput
from bench.sim.latency_model import ProfiledModel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_short_sweep_writes_results_plots_and_the_command(tmp_path):
    # A synthetic latency model stands in for a profile of this machine (bench.profile makes real ones).
    prefill = ProfiledModel.fit_prefill([([n], 0.01 + n * 1e-4) for n in (16, 64, 256, 512)], 1, 46080, 20000)
    decode = ProfiledModel.fit_decode([(b, b * c, 0.03 + b * 1e-3) for b in (1, 4, 16) for c in (64, 256)], 1)
    profile = tmp_path / "profile.json"
    profile.write_text(prefill.merged(decode).to_json())
    out = goodput.main(
        [
            "--config", "colocated:mode=colocated",
            "--workload", "fixed:24,6", "--scale", "1",
            "--num-requests", "6", "--warmup", "2",
            "--rates", "1,2",
            "--profile", str(profile),
            "--out", str(tmp_path / "run"),
            "--quiet",
            "--", "--kv-cache-memory", str(32 * 2**20),
        ]
    )  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    (config,) = results["configs"]
    assert config["name"] == "colocated" and config["startup_s"] > 0
    for rate in ("1.0", "2.0"):
        run = config["runs"][rate]
        assert len(run["requests"]) == 6 and run["summary"]["failed"] == 0
        assert all(r["num_output_tokens"] == 6 for r in run["requests"])
        assert 0.0 <= run["summary"]["slo_attainment"] <= 1.0
    assert set(config["predicted_attainment"]) >= {"1.0", "2.0"} and config["predicted_goodput"] is not None
    assert set(config["slo_scale"]) == {str(f) for f in goodput.SLO_SCALES}
    for png in ("attainment.png", "latency_cdf.png", "slo_scale.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bench.goodput" in (out / "command.txt").read_text()
