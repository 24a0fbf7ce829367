"""Recommend a placement: which pools, TP degrees and replica counts give the most goodput per GPU.

Runs the DistServe-style search (bench.sim.placement) over a latency model — analytic (a model and a
GPU from bench.sim: plan for hardware we do not have) or profiled (``--profile`` from bench.profile:
this machine) — for a named workload and SLOs, prints the ranking and writes the best as a pdserve
cluster config (YAML, loadable by ``pdserve serve --config``).

    python -m bench.plan --model opt-13b --hardware A100-80GB --gpus 8 --workload chatbot \\
        --ttft-slo 0.25 --tpot-slo 0.1
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import RESULTS_DIR, print_table, write_json
from bench.sim.hardware import get_hardware
from bench.sim.latency_model import AnalyticModel, ProfiledModel
from bench.sim.models import get_model
from bench.sim.placement import search_placement
from bench.slo import SLO
from bench.workloads import build_workload


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="opt-13b", help="a model of bench.sim.models (analytic)")
    parser.add_argument("--hardware", default="A100-80GB", help="a GPU of bench.sim.hardware (analytic)")
    parser.add_argument("--profile", help="a latency model JSON from bench.profile instead of the analytic one")
    parser.add_argument("--gpus", type=int, default=8, help="GPU (or shard) budget")
    parser.add_argument("--tp", default="1,2,4,8", help="TP degrees to consider")
    parser.add_argument("--workload", default="chatbot")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-requests", type=int, default=600, help="requests per simulated probe")
    parser.add_argument("--ttft-slo", type=float, default=0.25)
    parser.add_argument("--tpot-slo", type=float, default=0.1)
    parser.add_argument("--kv-bandwidth", type=float, default=25e9, help="KV link between pools, bytes/s")
    parser.add_argument("--out", help="where to write the recommended cluster YAML")
    args = parser.parse_args(argv)
    if args.profile:
        latency = ProfiledModel.from_json(Path(args.profile).read_text())
        name = latency.name or "profile"
    else:
        latency = AnalyticModel(get_model(args.model), get_hardware(args.hardware))
        name = f"{args.model}-{args.hardware}"
    slo = SLO(args.ttft_slo, args.tpot_slo)

    def workload(rate: float):
        return build_workload(
            args.workload, rate, args.num_requests, max_model_len=args.max_model_len, scale=args.scale
        )

    tps = [int(t) for t in args.tp.split(",")]
    result = search_placement(latency, workload, slo, args.gpus, tp_options=tps, kv_link_bandwidth=args.kv_bandwidth)
    rows = [
        {"placement": c.spec.describe(), "gpus": c.num_gpus, "goodput": c.goodput, "per_gpu": c.per_gpu_goodput}
        for c in result.table[:12]
    ]
    print_table(
        f"Placements for {name}, {args.workload}, SLO TTFT {slo.ttft_s}s TPOT {slo.tpot_s}s", rows, list(rows[0])
    )
    colocated, disagg = result.best_of("colocated"), result.best_of("disagg")
    ratio = disagg.per_gpu_goodput / colocated.per_gpu_goodput if colocated and disagg and colocated.goodput else None
    tp1 = [c for c in result.table if c.spec.mode == "colocated" and c.spec.colocated_tp == 1]
    ratio_tp1 = disagg.per_gpu_goodput / tp1[0].per_gpu_goodput if disagg and tp1 and tp1[0].goodput else None
    print(
        f"\nbest: {result.best.spec.describe()} — disagg/colocated per-GPU goodput {ratio and round(ratio, 2)}"
        f" (vs colocated TP=1: {ratio_tp1 and round(ratio_tp1, 2)})"
    )
    out = Path(args.out) if args.out else RESULTS_DIR / f"plan_{name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    hint = (
        "" if args.profile else f"# Set `model:` to {args.model}'s weights before `pdserve serve --config` this file.\n"
    )
    out.write_text(hint + result.to_yaml())
    print(f"wrote the recommended cluster config to {out}")
    summary = {"args": vars(args), "rows": rows, "disagg_over_colocated": ratio, "disagg_over_colocated_tp1": ratio_tp1}
    write_json(f"plan_{name}", summary)
    return summary


if __name__ == "__main__":
    main()
