"""bench.placement runs the router's real placement path and reports what it measured."""

from __future__ import annotations

import argparse

from bench.placement import time_placement


def test_the_placement_bench_times_every_request_and_finds_the_shared_prefix():
    args = argparse.Namespace(cached_blocks=500, requests=40, policy="cache_aware")
    row = time_placement(args, num_replicas=3, prompt_tokens=256)
    assert row["replicas"] == 3 and row["cached_blocks_each"] == 500
    assert 0 < row["place_p50_ms"] <= row["place_p99_ms"] <= row["place_max_ms"]
    assert row["report_in_ms"] > 0
    # Half the prompts share a 128-token prefix held by one replica; random queues of up to 4,096
    # tokens decide the rest, so only some of them go there, never none.
    assert 0 < row["shared_prefix_to_its_replica"] <= 1
