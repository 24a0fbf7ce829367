"""How long the router takes to place one request, with large prefix caches on every replica.

Times ``router.pool_placement.PoolPlacement.place`` and ``routed`` (what the router's Serve
request router runs for every call on a pool's handle: the load view, hashing the prompt's blocks
as the engines do, the prefix-index lookup on every replica, the cache-aware policy, then
remembering where the prompt went) against replicas that each
report ``--cached-blocks`` cached blocks, for prompts of several lengths, half of them sharing a
prefix cached on one replica. Also times taking in one changed report (unpacking its cached
blocks), which happens once per report (every second per replica), not per request. Target: place
≤ 1 ms at p99 with 10,000 cached prefixes per replica. Prints a table and writes
bench/results/placement.json.

    python -m bench.placement [--replicas 2 8] [--cached-blocks 10000] [--prompt-tokens 256 2048]
        [--requests 2000] [--policy cache_aware]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from bench.common import print_table, write_json
from common.block_hash import hash_full_blocks, pack_short_hashes, short_hashes
from common.sampling_params import SamplingParams
from common.serving import ReplicaReport, ServeRequest
from router.pool_placement import PoolPlacement

BLOCK_SIZE = 16


def make_reports(num_replicas: int, num_cached: int, shared: list[int], rng: random.Random) -> list[ReplicaReport]:
    now = time.time()
    reports = []
    for i in range(num_replicas):
        cached = [rng.randbytes(8) for _ in range(num_cached)]
        if i == 0:  # the shared prefix lives on the first replica
            cached[: len(shared) // BLOCK_SIZE] = short_hashes(hash_full_blocks(shared, BLOCK_SIZE))
        reports.append(
            ReplicaReport(
                replica_id=f"replica-{i}",
                role="prefill",
                num_running=rng.randrange(8),
                num_waiting=rng.randrange(4),
                num_kv_blocks_free=20_000,
                num_kv_blocks_total=40_000,
                max_model_len=8192,
                cached_blocks=pack_short_hashes(cached),
                num_prefill_tokens_queued=rng.randrange(4096),
                prefill_tokens_per_s=2000.0,
                report_time=now,
            )
        )
    return reports


def time_placement(args: argparse.Namespace, num_replicas: int, prompt_tokens: int) -> dict:
    rng = random.Random(num_replicas * 100_003 + prompt_tokens)
    shared = [rng.randrange(49_000) for _ in range(prompt_tokens // 2)]
    reports = make_reports(num_replicas, args.cached_blocks, shared, rng)
    placement = PoolPlacement(args.policy, "prefill", BLOCK_SIZE)
    started = time.perf_counter()
    placement.observe(reports, every_replica=True)
    observe_s = (time.perf_counter() - started) / num_replicas
    params = SamplingParams(max_tokens=16).to_dict()
    times, hits = [], 0
    for i in range(args.requests):
        tail = [rng.randrange(49_000) for _ in range(prompt_tokens - len(shared))]
        head = shared if i % 2 == 0 else [rng.randrange(49_000) for _ in range(len(shared))]
        request = ServeRequest(f"req-{i}", head + tail, params)
        in_flight = {r.replica_id: rng.randrange(4) for r in reports}
        started = time.perf_counter()
        chosen = placement.place(request, reports, in_flight)
        placement.routed(request, chosen.replica_id)  # what the router does once Serve has sent it
        times.append(time.perf_counter() - started)
        hits += i % 2 == 0 and chosen.replica_id == "replica-0"
    p50, p99 = np.percentile(times, [50, 99])
    return {
        "replicas": num_replicas,
        "prompt_tokens": prompt_tokens,
        "cached_blocks_each": args.cached_blocks,
        "place_p50_ms": p50 * 1e3,
        "place_p99_ms": p99 * 1e3,
        "place_max_ms": max(times) * 1e3,
        "report_in_ms": observe_s * 1e3,
        "shared_prefix_to_its_replica": hits / max(1, (args.requests + 1) // 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--cached-blocks", type=int, default=10_000)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--policy", default="cache_aware")
    args = parser.parse_args(argv)
    rows = [time_placement(args, n, tokens) for n in args.replicas for tokens in args.prompt_tokens]
    columns = [
        "replicas",
        "prompt_tokens",
        "place_p50_ms",
        "place_p99_ms",
        "place_max_ms",
        "report_in_ms",
        "shared_prefix_to_its_replica",
    ]
    print_table(f"placement ({args.policy}), {args.cached_blocks} cached blocks per replica", rows, columns)
    write_json("placement", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
