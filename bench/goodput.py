"""Goodput experiments (DistServe, OSDI 2024) on real local clusters, side by side.

For each cluster configuration, in turn: start ``pdserve serve`` with it, send the same seeded
workload at each request rate of the sweep (open loop, streaming), then bisect for the goodput —
the highest rate at which >= 90% of requests meet both the TTFT and TPOT SLOs. The SLO-scale
sweep reuses the timings of one rate with every SLO multiplied by a common factor. With
``--profile`` the simulator, driven by a latency model fitted on this machine (bench.profile),
predicts the same curves, and the table shows predicted beside measured goodput.

Writes a results folder: ``results.json`` (every request's timings), ``attainment.png``
(attainment vs rate, every configuration), ``latency_cdf.png``, ``slo_scale.png`` and
``command.txt`` (the exact command and configurations). A ``mode=disagg`` configuration sends
every prompt to the prefill pool unless it sets ``conditional_disaggregation=true``.

    python -m bench.goodput --config colocated:mode=colocated,replicas=2 \\
        --config disagg:mode=disagg,prefill_replicas=1,decode_replicas=1 \\
        --workload chatbot --scale 0.1 --rates 0.5,1,2 --ttft-slo 1.0 --tpot-slo 0.15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import RESULTS_DIR, print_table
from bench.load_client import LoadResult, run_load
from bench.server_process import start_server
from bench.sim.latency_model import ProfiledModel
from bench.sim.simulator import ClusterSpec, simulate
from bench.slo import SLO, RequestTiming, attainment, find_goodput
from bench.workloads import build_workload

MODEL = "SmolLM2-135M-Instruct"
# config key -> `pdserve serve` flag
_FLAGS = {
    "mode": "--mode",
    "prefill_replicas": "--prefill-replicas",
    "decode_replicas": "--decode-replicas",
    "prefill_tp": "--prefill-tp",
    "decode_tp": "--decode-tp",
    "replicas": "--replicas",
    "tp": "--tp",
    "transport": "--transport",
    "prefill_cores": "--prefill-cores",
    "decode_cores": "--decode-cores",
    "cores": "--cores",
    "dtype": "--dtype",
}
# config key -> the `pdserve serve --set` key it sets (no flag of its own, or a flag without a value)
_SET_KEYS = {
    "conditional_disaggregation": "router.conditional_disaggregation",
    "local_prefill_max_stall_s": "router.local_prefill_max_stall_s",
    "placement_policy": "router.placement_policy",
}
SLO_SCALES = (0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0)


@dataclass
class Configuration:
    name: str
    settings: dict[str, str]
    measured: dict[float, LoadResult] = field(default_factory=dict)
    goodput: float | None = None
    predicted: dict[float, float] = field(default_factory=dict)  # rate -> simulated attainment
    predicted_goodput: float | None = None
    startup_s: float | None = None

    @classmethod
    def parse(cls, text: str) -> Configuration:
        name, _, body = text.partition(":")
        settings = dict(item.split("=", 1) for item in body.split(",") if item)
        unknown = set(settings) - set(_FLAGS) - set(_SET_KEYS)
        if not name or unknown:
            known = sorted([*_FLAGS, *_SET_KEYS])
            raise SystemExit(f"--config {text!r}: write NAME:key=value,... with keys from {known}")
        return cls(name, settings)

    def serve_args(self, extra: list[str]) -> list[str]:
        args = [] if "mode" in self.settings else ["--mode", "disagg"]  # what spec() models, not serve's auto
        for key, value in self.settings.items():
            args += [_FLAGS[key], value] if key in _FLAGS else ["--set", f"{_SET_KEYS[key]}={value}"]
        if self.settings.get("mode", "disagg") == "disagg" and "conditional_disaggregation" not in self.settings:
            # DistServe's disaggregation, as the simulator models it: every prompt to the prefill
            # pool (`pdserve serve` itself defaults to conditional disaggregation).
            args += ["--no-conditional-disaggregation"]
        return args + extra

    def spec(self) -> ClusterSpec:
        """The simulator's cluster (it models pools and replicas, not the router's options)."""
        s = {k: int(v) for k, v in self.settings.items() if k not in ("mode", "transport", "dtype", *_SET_KEYS)}
        if self.settings.get("mode", "disagg") == "colocated":
            return ClusterSpec("colocated", colocated_replicas=s.get("replicas", 1), colocated_tp=s.get("tp", 1))
        return ClusterSpec(
            "disagg",
            prefill_replicas=s.get("prefill_replicas", 1),
            prefill_tp=s.get("prefill_tp", 1),
            decode_replicas=s.get("decode_replicas", 1),
            decode_tp=s.get("decode_tp", 1),
        )


def _workload(args: argparse.Namespace, rate: float, tokenizer=None):
    # The same prompts for every configuration at a rate, other prompts at another rate: one server
    # measures every rate in turn, and prompts it saw at an earlier rate would hit its prefix cache.
    return build_workload(
        args.workload, rate, args.num_requests, seed=args.seed + round(rate * 1000), max_model_len=args.max_model_len,
        scale=args.scale, tokenizer=tokenizer,
    )  # fmt: skip


def measure(config: Configuration, args: argparse.Namespace, slo: SLO, tokenizer) -> None:
    server = start_server(config.serve_args(args.serve_args))
    config.startup_s = server.startup_s
    try:
        if args.warmup:
            # Not measured: a fresh server's first requests run slower (first-time code paths and
            # memory), and would count against whichever rate happens to be measured first.
            warmup = build_workload(
                args.workload, min(args.rates), args.warmup, seed=args.seed + 1, max_model_len=args.max_model_len,
                scale=args.scale, tokenizer=tokenizer,
            )  # fmt: skip
            asyncio.run(run_load(server.base_url, MODEL, warmup, progress=False, timeout_s=args.timeout))

        def attainment_at(rate: float) -> float:
            if rate not in config.measured:
                workload = _workload(args, rate, tokenizer)
                config.measured[rate] = asyncio.run(
                    run_load(server.base_url, MODEL, workload, progress=not args.quiet, timeout_s=args.timeout)
                )
            return attainment(config.measured[rate].timings(), slo)

        for rate in args.rates:
            attainment_at(rate)
        if args.search:
            config.goodput, _ = find_goodput(
                attainment_at, min(args.rates), max(args.rates), max_probes=args.max_probes
            )
    finally:
        server.stop()


def predict(config: Configuration, args: argparse.Namespace, slo: SLO, model: ProfiledModel) -> None:
    def attainment_at(rate: float) -> float:
        if rate not in config.predicted:
            result = simulate(config.spec(), _workload(args, rate), model, kv_link_bandwidth=args.kv_bandwidth)
            config.predicted[rate] = result.attainment(slo)
        return config.predicted[rate]

    for rate in sorted(set(args.rates) | set(config.measured)):
        attainment_at(rate)
    config.predicted_goodput, _ = find_goodput(attainment_at, min(args.rates), max(args.rates) * 4, max_probes=16)


def plot(configs: list[Configuration], slo: SLO, out: Path, slo_rate: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in configs:
        rates = sorted(c.measured)
        line = ax.plot(rates, [attainment(c.measured[r].timings(), slo) for r in rates], "o-", label=c.name)[0]
        if c.predicted:
            p_rates = sorted(c.predicted)
            ax.plot(p_rates, [c.predicted[r] for r in p_rates], "--", color=line.get_color(), label=f"{c.name} (sim)")
    ax.axhline(0.9, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment", ylim=(0, 1.05), title="SLO attainment vs rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "attainment.png", dpi=120)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for c in configs:
        result = c.measured.get(slo_rate)
        if result is None:
            continue
        for axis, values, limit in (
            (axes[0], sorted(t.ttft_s for t in result.timings() if t.ttft_s is not None), slo.ttft_s),
            (axes[1], sorted(t.tpot_s for t in result.timings() if t.tpot_s is not None), slo.tpot_s),
        ):
            axis.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=c.name)
            axis.axvline(limit, color="grey", lw=0.8, ls=":")
    axes[0].set(xlabel="TTFT (s)", ylabel="CDF", title=f"TTFT at {slo_rate} req/s")
    axes[1].set(xlabel="TPOT (s)", title=f"TPOT at {slo_rate} req/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in configs:
        result = c.measured.get(slo_rate)
        if result is not None:
            timings = result.timings()
            ax.plot(SLO_SCALES, [attainment(timings, slo.scaled(f)) for f in SLO_SCALES], "o-", label=c.name)
    ax.axhline(0.9, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="SLO scale", ylabel="SLO attainment", ylim=(0, 1.05), title=f"SLO scale at {slo_rate} req/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "slo_scale.png", dpi=120)
    plt.close("all")


def slo_scale_table(timings: list[RequestTiming], slo: SLO) -> dict[str, float]:
    return {str(f): attainment(timings, slo.scaled(f)) for f in SLO_SCALES}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", required=True, help="NAME:key=value,... (see _FLAGS)")
    parser.add_argument("--workload", default="chatbot")
    parser.add_argument("--scale", type=float, default=0.1, help="shrink the workload's lengths (CPU machines)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured requests first, on each fresh server")
    parser.add_argument("--rates", default="0.5,1,2", help="comma-separated request rates (req/s)")
    parser.add_argument("--search", action="store_true", help="bisect for each configuration's goodput")
    parser.add_argument("--max-probes", type=int, default=6)
    parser.add_argument("--ttft-slo", type=float, default=1.0)
    parser.add_argument("--tpot-slo", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--profile", help="latency model JSON from bench.profile: add simulated predictions")
    parser.add_argument("--kv-bandwidth", type=float, default=2e9, help="KV link bytes/s for the simulator")
    parser.add_argument("--out", help="results folder (default bench/results/goodput-<time>)")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("serve_args", nargs="*", help="extra `pdserve serve` flags for every configuration, after --")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    slo = SLO(args.ttft_slo, args.tpot_slo)
    configs = [Configuration.parse(text) for text in args.config]
    out = Path(args.out) if args.out else RESULTS_DIR / time.strftime("goodput-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text(
        shlex.join([sys.executable, "-m", "bench.goodput", *(argv or sys.argv[1:])]) + "\n"
    )

    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None, None)))
    model = ProfiledModel.from_json(Path(args.profile).read_text()) if args.profile else None
    for config in configs:
        measure(config, args, slo, tokenizer)
        if model is not None:
            predict(config, args, slo, model)

    slo_rate = min(args.rates)
    rows = []
    for c in configs:
        for rate in sorted(c.measured):
            summary = c.measured[rate].summary(slo)
            rows.append(
                {
                    "config": c.name,
                    "rate": rate,
                    "attainment": summary["slo_attainment"],
                    "predicted": c.predicted.get(rate),
                    "ttft_p50": summary["p50_ttft_s"],
                    "tpot_p50": summary["p50_tpot_s"],
                    "failed": summary["failed"],
                }
            )
    print_table(f"SLO attainment (TTFT <= {slo.ttft_s}s, TPOT <= {slo.tpot_s}s)", rows, list(rows[0]))
    goodputs = [
        {"config": c.name, "startup_s": c.startup_s, "goodput": c.goodput, "predicted_goodput": c.predicted_goodput}
        for c in configs
    ]
    print_table("Goodput (req/s at >= 90% attainment)", goodputs, list(goodputs[0]))
    payload = {
        "args": {k: v for k, v in vars(args).items()},
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "configs": [
            {
                "name": c.name,
                "settings": c.settings,
                "serve_args": c.serve_args(args.serve_args),
                "startup_s": c.startup_s,
                "goodput": c.goodput,
                "predicted_goodput": c.predicted_goodput,
                "predicted_attainment": {str(r): a for r, a in sorted(c.predicted.items())},
                "slo_scale": slo_scale_table(c.measured[slo_rate].timings(), slo) if slo_rate in c.measured else None,
                "runs": {str(r): c.measured[r].to_json(slo) for r in sorted(c.measured)},
            }
            for c in configs
        ],
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    plot(configs, slo, out, slo_rate)
    print(f"\nwrote {out}/results.json, attainment.png, latency_cdf.png, slo_scale.png, command.txt")
    return out


if __name__ == "__main__":
    main()
