"""TTFT / TPOT of the served cluster, disaggregated vs colocated, side by side in one run.

Starts ``pdserve serve`` (the public entry point) once per mode, measures its start-up time, then
streams a handful of requests through the OpenAI API, first one at a time, then ``--concurrency``
at once, timing each token as the client sees it (TTFT: request sent → first text chunk; TPOT:
the mean gap between later chunks). Prints a table and writes bench/results/serving_latency.json.

    python -m bench.serving_latency [--requests 8] [--concurrency 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time

from bench.common import print_table, write_json
from bench.server_process import start_server

MODEL = "SmolLM2-135M-Instruct"
_PROMPT = (
    "Lighthouses once burned wood and coal on open platforms; later towers carried oil lamps behind "
    "polished reflectors, and the Fresnel lens bent their light into beams seen twenty miles away. "
)


def stream_one(port: int, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.monotonic()
    connection.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    times = []
    for line in response:
        if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
            times.append(time.monotonic())
    connection.close()
    ttft = times[0] - sent
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return {"ttft": ttft, "tpot": tpot, "chunks": len(times)}


def _append(results: list[dict], port: int, prompt: str, max_tokens: int) -> None:
    results.append(stream_one(port, prompt, max_tokens))


def run_mode(mode: str, args: argparse.Namespace) -> list[dict]:
    # Disaggregated as DistServe measures it: every prompt's KV crosses (not the conditional default).
    pure = ["--no-conditional-disaggregation"] if mode == "disagg" else []
    server = start_server(["--mode", mode, *pure, *args.serve_args])
    port, startup = server.port, server.startup_s
    rows = []
    try:
        stream_one(port, "warm up", 4)
        for concurrency in (1, args.concurrency):
            results: list[dict] = []
            for start in range(0, args.requests, concurrency):
                batch = range(start, min(start + concurrency, args.requests))
                threads = [
                    threading.Thread(target=_append, args=(results, port, f"{_PROMPT} ({i})", args.max_tokens))
                    for i in batch
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            rows.append(
                {
                    "mode": mode,
                    "concurrency": concurrency,
                    "requests": len(results),
                    "startup_s": startup,
                    "ttft_median_s": statistics.median(r["ttft"] for r in results),
                    "tpot_median_s": statistics.median(r["tpot"] for r in results if r["tpot"] is not None),
                }
            )
    finally:
        server.stop()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", default="colocated,disagg")
    parser.add_argument("serve_args", nargs="*", help="extra `pdserve serve` flags, after --")
    args = parser.parse_args(argv)
    rows = [row for mode in args.modes.split(",") for row in run_mode(mode, args)]
    columns = ["mode", "concurrency", "requests", "startup_s", "ttft_median_s", "tpot_median_s"]
    print_table("Serving latency (client side, streamed completions)", rows, columns)
    write_json("serving_latency", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
