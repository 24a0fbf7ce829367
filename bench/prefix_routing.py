"""Cache-aware placement against least-loaded and random, on a multi-turn chat workload, in one run.

Starts ``pdserve serve`` once per placement policy (same cluster shape, same seeded workload, a
fresh prefix cache each time), replays the workload open-loop through the OpenAI API, and reports
per policy: the prefix-cache hit rate (prompt tokens the servers' usage says were cached, over all
prompt tokens) next to the reachable one (one cache shared by all replicas, with this run's
timing: a prompt can reuse an earlier one only once that one's prefill is done), TTFT p50/p99,
TPOT p50 and failures; the per-replica hit counters from the router's /metrics show where the
hits happened. Prints a table and writes
bench/results/prefix_routing.json.

    python -m bench.prefix_routing [--policies cache_aware least_loaded random] [--rate 1.5]
        [--num-requests 64] [--workload multiturn] [--mode disagg] [--replicas 2] [--seed 0]
        [--serve-arg=--dtype --serve-arg=bfloat16 ...]

``--replicas`` is the prefill pool's (disaggregated) or the one pool's (colocated) replica count.
On a small CPU host the replicas share its cores (``pdserve serve`` logs the oversubscription), so
TTFT here shows queueing as much as compute; the hit rate is the policy's own figure.
"""

from __future__ import annotations

import argparse
import asyncio
import urllib.request

from bench.common import print_table, write_json
from bench.load_client import run_load
from bench.server_process import start_server
from bench.workloads import build_workload

MODEL = "SmolLM2-135M-Instruct"
POLICIES = ("cache_aware", "least_loaded", "random")


def replica_hits(port: int) -> dict[str, tuple[float, float]]:
    """Replica -> (prompt tokens queried, found) in its prefix cache, from the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    queried: dict[str, float] = {}
    hits: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = f"{sample.labels.get('pool')}/{sample.labels.get('replica', '')[-6:]}"
            if sample.name == "pdserve:prefix_cache_queries_total":
                queried[key] = sample.value
            elif sample.name == "pdserve:prefix_cache_hits_total":
                hits[key] = sample.value
    return {key: (queried[key], hits.get(key, 0.0)) for key in sorted(queried)}


def reachable_hit_rate(prompt_ids: list[list[int]], records, block_size: int = 16) -> float | None:
    """The hit rate of one cache shared by every replica, as this run's timing allowed: a request
    can reuse the full blocks it shares with an earlier request whose first token (its prefill
    done) came before this one was sent. The ceiling any placement could reach on this run."""
    done = [(r.send_s + r.ttft_s) if r.ttft_s is not None else None for r in records]
    total = hits = 0
    for i, (ids, record) in enumerate(zip(prompt_ids, records, strict=True)):
        best = 0
        for j, other in enumerate(prompt_ids):
            if j == i or done[j] is None or done[j] > record.send_s:
                continue
            n, limit = 0, min(len(ids), len(other))
            while n < limit and ids[n] == other[n]:
                n += 1
            best = max(best, n)
        total += len(ids)
        hits += min(best // block_size * block_size, len(ids) - 1)
    return hits / total if total else None


def run_policy(policy: str, args: argparse.Namespace, workload, prompt_ids: list[list[int]]) -> dict:
    # Disaggregated, every prompt goes to the prefill pool: its placement is what is measured.
    shape = (
        ["--prefill-replicas", str(args.replicas), "--no-conditional-disaggregation"]
        if args.mode == "disagg"
        else ["--replicas", str(args.replicas)]
    )
    server = start_server(["--mode", args.mode, *shape, "--set", f"router.placement_policy={policy}", *args.serve_arg])
    try:
        result = asyncio.run(run_load(server.base_url, MODEL, workload, progress=False))
        summary = result.summary()
        hits = replica_hits(server.port)
    finally:
        server.stop()
    row = {
        "policy": policy,
        "hit_rate": summary["prefix_cache_hit_rate"],
        "reachable": reachable_hit_rate(prompt_ids, sorted(result.records, key=lambda r: r.index)),
        "ttft_p50_s": summary["p50_ttft_s"],
        "ttft_p99_s": summary["p99_ttft_s"],
        "tpot_p50_s": summary["p50_tpot_s"],
        "req_per_s": summary["request_throughput"],
        "failed": summary["failed"],
        "replica_hits": {key: f"{int(found)}/{int(queried)}" for key, (queried, found) in hits.items()},
    }
    return {"row": row, "summary": summary, "requests": result.to_json()["requests"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--workload", default="multiturn", help="bench.workloads name (multiturn[:S,T[,N]])")
    parser.add_argument("--rate", type=float, default=1.5, help="turns per second, Poisson")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[], help="passed to pdserve serve (repeat)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from engine.model_loader import DEFAULT_MODEL_NAME, resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(DEFAULT_MODEL_NAME, None)))
    workload = build_workload(args.workload, args.rate, args.num_requests, seed=args.seed, tokenizer=tokenizer)
    prompt_ids = [tokenizer.encode(request.prompt) for request in workload]  # as the server tokenizes them
    results = {policy: run_policy(policy, args, workload, prompt_ids) for policy in args.policies}
    rows = [r["row"] for r in results.values()]
    title = (
        f"{args.workload}, {len(workload)} requests at {args.rate}/s, {args.mode}, "
        f"{args.replicas} {'prefill ' if args.mode == 'disagg' else ''}replicas"
    )
    columns = ["policy", "hit_rate", "reachable", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "req_per_s", "failed"]
    print_table(title, rows, columns)
    for row in rows:
        print(f"  {row['policy']}: hits/queried tokens per replica {row['replica_hits']}")
    write_json("prefix_routing", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
