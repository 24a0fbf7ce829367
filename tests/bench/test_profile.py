"""`bench.profile` measures a real engine and fits a latency model the simulator can load."""

from __future__ import annotations

import pytest

from bench import profile as bench_profile
from bench.sim.latency_model import ProfiledModel

pytestmark = pytest.mark.slow


def test_profile_fits_a_loadable_model_that_tracks_its_measurements(tiny_dir, tmp_path):
    out = tmp_path / "profile.json"
    bench_profile.main(["--model", str(tiny_dir), "--quick", "--kv-cache-memory", str(64 * 2**20), "--out", str(out)])
    model = ProfiledModel.from_json(out.read_text())
    assert model.supports_tp(1) and model.kv_bytes_per_token > 0 and model.max_kv_tokens(1) > 0
    # More prompt tokens take longer; a bigger decode batch is not cheaper per step.
    assert model.prefill_time([512], 1) > model.prefill_time([16], 1)
    assert model.decode_step_time(16, 16 * 64, 1) >= model.decode_step_time(1, 64, 1) * 0.5
