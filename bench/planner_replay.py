"""The SLO planner against static configurations, on one bursty trace whose rate changes over time.

Builds the trace from ``--phases`` (each ``RATE:SECONDS[:BURSTINESS]``: gamma arrivals, Poisson at
burstiness 1), writes it (pdserve's trace format, replayable by ``pdserve bench load`` and the
simulator), then for each configuration starts ``pdserve serve`` with it, replays the trace (open
loop, streaming) while polling ``/pdserve/status`` every second, and stops it. Reported per
configuration: SLO attainment (TTFT and TPOT), failures, and replica-seconds and core-seconds over
the replay (each poll's replicas, and the CPU cores each owns, times the poll's interval). With
``--profile`` (a latency model from ``bench.profile``) the simulator replays the same trace through
each static configuration beside it (it has no planner: its rows are the static counts).

    python -m bench.planner_replay --phases 0.5:40,3:30:4,0.5:40 --input-len 256 --output-len 32
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench.common import RESULTS_DIR, print_table, write_json
from bench.load_client import LoadResult, run_load
from bench.server_process import start_server
from bench.slo import SLO, attainment
from bench.traces import TraceRequest, write_trace
from bench.workloads import WorkloadRequest, arrival_times, make_prompt

MODEL = "SmolLM2-135M-Instruct"
# name -> `pdserve serve` arguments.
_PLANNER = [
    "--mode",
    "disagg",
    "--set",
    "planner.enabled=true",
    "--set",
    "planner.interval_s=2",
    "--set",
    "planner.max_replicas={prefill: 2, decode: 1}",
    "--set",
    "planner.down_after=5",
    "--set",
    "planner.cooldown_s=20",
]
CONFIGS = {
    "planner P1-2 + D1": _PLANNER,  # its budget: the host's cores
    "planner, budget 3": [*_PLANNER, "--set", "planner.budget=3"],  # past a 2-core host's cores
    "static P2 + D1": ["--mode", "disagg", "--prefill-replicas", "2"],
    "static P1 + D1": ["--mode", "disagg"],
}  # fmt: skip


def parse_phases(text: str) -> list[tuple[float, float, float]]:
    phases = []
    for part in text.split(","):
        fields = [float(v) for v in part.split(":")]
        if len(fields) not in (2, 3) or fields[0] <= 0 or fields[1] <= 0:
            raise SystemExit(f"--phases: {part!r} is not RATE:SECONDS[:BURSTINESS]")
        phases.append((fields[0], fields[1], fields[2] if len(fields) == 3 else 1.0))
    return phases


def build_trace(phases: list[tuple[float, float, float]], input_len: int, output_len: int, seed: int):
    """Arrival times phase after phase (each phase's arrivals within its own span)."""
    rng = np.random.default_rng(seed)
    arrivals: list[float] = []
    start = 0.0
    for rate, seconds, burstiness in phases:
        times = arrival_times("gamma", rate, int(rate * seconds * 2) + 8, rng, burstiness)
        arrivals += [start + float(t) for t in times if t < seconds]
        start += seconds
    return [TraceRequest(t, input_len, output_len) for t in arrivals]


def _poll(url: str, stop: threading.Event, samples: list[tuple[float, int, int]], interval_s: float = 1.0) -> None:
    """(time, replicas, cores) of every pool together, once a second, until ``stop``."""
    while not stop.wait(interval_s):
        try:
            with urllib.request.urlopen(url + "/pdserve/status", timeout=10) as response:
                pools = json.loads(response.read())["pools"]
        except OSError:
            continue
        reports = [r for pool in pools.values() for r in pool if not r.get("draining")]
        samples.append((time.monotonic(), len(reports), sum(max(1, len(r.get("cpu_cores", []))) for r in reports)))


def replay(serve_args: list[str], workload: list[WorkloadRequest], timeout_s: float) -> tuple[LoadResult, dict]:
    server = start_server(serve_args)
    samples: list[tuple[float, int, int]] = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(f"http://127.0.0.1:{server.port}", stop, samples), daemon=True)
    try:
        poller.start()
        result = asyncio.run(run_load(server.base_url, MODEL, workload, progress=False, timeout_s=timeout_s))
    finally:
        stop.set()
        poller.join(5)
        server.stop()
    spans = [(b[0] - a[0], a[1], a[2]) for a, b in itertools.pairwise(samples)]
    usage = {
        "replica_s": sum(dt * replicas for dt, replicas, _ in spans),
        "core_s": sum(dt * cores for dt, _, cores in spans),
        "max_replicas": max((r for _, r, _ in samples), default=0),
    }
    return result, usage


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", default="0.5:40,3:30:4,0.5:40", help="RATE:SECONDS[:BURSTINESS],...")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--ttft-slo", type=float, default=1.0)
    parser.add_argument("--tpot-slo", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"some of: {', '.join(CONFIGS)}")
    parser.add_argument("--profile", help="a latency model JSON (bench.profile): simulate the static rows too")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    trace = build_trace(parse_phases(args.phases), args.input_len, args.output_len, args.seed)
    trace_path = write_trace(RESULTS_DIR / "planner_trace.jsonl", trace)
    workload = [
        WorkloadRequest(r.arrival_s, make_prompt(tokenizer, r.num_prompt_tokens, seed=i), r.num_prompt_tokens,
                        r.num_output_tokens)
        for i, r in enumerate(trace)
    ]  # fmt: skip
    slo = SLO(args.ttft_slo, args.tpot_slo)
    rows = []
    for name in [n for n in args.configs.split(",") if n]:  # "": the simulator only
        result, usage = replay(CONFIGS[name], workload, args.timeout)
        timings = result.timings()
        rows.append(
            {
                "configuration": name,
                "requests": len(timings),
                "failed": sum(not t.succeeded for t in timings),
                "attainment": attainment(timings, slo),
                "TTFT p90 s": float(np.percentile([t.ttft_s for t in timings if t.ttft_s is not None] or [0], 90)),
                "replica-s": usage["replica_s"],
                "core-s": usage["core_s"],
                "max replicas": usage["max_replicas"],
            }
        )
    if args.profile:
        from bench.sim.latency_model import ProfiledModel
        from bench.sim.simulator import ClusterSpec, simulate

        model = ProfiledModel.from_json(Path(args.profile).read_text())
        for name, prefill in (("simulated P2 + D1", 2), ("simulated P1 + D1", 1)):
            predicted = simulate(ClusterSpec(prefill_replicas=prefill), trace, model)
            ttfts = [t.ttft_s for t in predicted.timings if t.ttft_s is not None] or [0.0]
            rows.append(
                {
                    "configuration": name,
                    "requests": len(trace),
                    "failed": predicted.num_failed,
                    "attainment": predicted.attainment(slo),
                    "TTFT p90 s": float(np.percentile(ttfts, 90)),
                    "replica-s": (prefill + 1) * trace[-1].arrival_s,
                }
            )
    print_table(
        f"SLO planner vs static, one trace ({args.phases}; {len(trace)} requests of {args.input_len}/"
        f"{args.output_len} tokens; SLO TTFT {slo.ttft_s} s, TPOT {slo.tpot_s} s)",
        rows,
        list(rows[0]),
    )
    summary = {"args": vars(args), "trace": str(trace_path), "rows": rows}
    write_json("planner_replay", summary)
    return summary


if __name__ == "__main__":
    main()
