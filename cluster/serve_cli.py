"""``pdserve serve | status | scale``: run a cluster, look at it, resize its pools.

``serve`` records the running configuration in ``common.env.run_state_file()``; ``status`` asks the
router over HTTP; ``scale`` joins the running Ray cluster and redeploys with new replica counts,
which Serve applies in place (replicas leaving are drained first).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
import urllib.error
import urllib.request
from typing import Any

from cluster.cluster_config import ClusterConfig, load_cluster_config, parse_override
from cluster.config_flags import ListConfigFlags, add_config_flags, config_overrides
from common import env
from common.cpu_cores import format_core_list
from common.errors import ConfigError
from router.auth import ADMIN_KEY_ENV

logger = logging.getLogger(__name__)

# CLI flag -> dotted config key (flags override the file; --set overrides anything). Every other
# key has a generated flag (cluster.config_flags).
FLAG_KEYS = {
    "mode": "mode",
    "model": "model",
    "served_model_name": "served_model_name",
    "max_model_len": "max_model_len",
    "tensor_parallel_size": "tensor_parallel_size",
    "api_key": "api_keys",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "chat_template": "chat_template",
    "enable_prefix_caching": "enable_prefix_caching",
    "revision": "revision",
    "allowed_origins": "router.allowed_origins",
    "ssl_keyfile": "router.ssl_keyfile",
    "ssl_certfile": "router.ssl_certfile",
    "access_log": "router.access_log",
    "host": "host",
    "port": "port",
    "dtype": "dtype",
    "compile": "compile",
    "enforce_eager": "enforce_eager",
    "attention_backend": "attention_backend",
    "transport": "transport",
    "address": "ray_address",
    "kv_host": "kv_host",
    "stream_interval": "stream_interval",
    "conditional_disaggregation": "router.conditional_disaggregation",
    "tracing": "tracing",
    "kv_cache_memory": "kv_cache_memory",
    "prefill_replicas": "prefill.replicas",
    "decode_replicas": "decode.replicas",
    "prefill_tp": "prefill.tensor_parallel_size",
    "decode_tp": "decode.tensor_parallel_size",
    "replicas": "colocated.replicas",
    "prefill_cores": "prefill.cores",
    "decode_cores": "decode.cores",
    "cores": "colocated.cores",
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="a Hugging Face directory, a .gguf file or a Hub id (org/name), as `vllm serve MODEL` "
        "(default: SmolLM2-135M-Instruct); --model says the same",
    )
    parser.add_argument("--config", help="cluster YAML (see cluster.example.yaml)")
    parser.add_argument(
        "--mode",
        choices=["auto", "disagg", "colocated"],
        help="auto (default): colocated on a CPU host of fewer than 4 cores, else disaggregated",
    )
    parser.add_argument("--model", help=argparse.SUPPRESS)
    add_vllm_arguments(parser)
    parser.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 8000)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CPU: run the layer stack through the compiled kernels (default on; --no-compile: plain torch, eager)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="CUDA: run every step eagerly (default: decode steps replay CUDA graphs captured at start-up)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "triton"],
        help="paged attention's kernels (default auto: triton on CUDA, torch elsewhere)",
    )
    parser.add_argument(
        "--transport",
        choices=["auto", "shm", "grpc", "torch", "tcp"],
        help="KV transport between pools (default auto: shm between replicas on one host, tcp between hosts)",
    )
    parser.add_argument(
        "--address",
        help="join a running Ray cluster (auto: the one `ray start` runs here; ray://HOST:PORT: a remote one) "
        "instead of starting a local Ray",
    )
    parser.add_argument(
        "--kv-host",
        help="where decode replicas' KV endpoints listen (default 127.0.0.1; node: each replica's Ray node address)",
    )
    parser.add_argument(
        "--stream-interval", type=int, help="tokens per streamed chunk after the first (default 1: every token)"
    )
    parser.add_argument(
        "--conditional-disaggregation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="disagg mode: a decode replica computes a prompt itself when that is sooner than the prefill pool "
        "(default on; --no-conditional-disaggregation sends every prompt to the prefill pool)",
    )
    parser.add_argument(
        "--tracing", help="where trace spans go: none (default), console, file:PATH or otlp (see tracing_endpoint)"
    )
    parser.add_argument("--kv-cache-memory", type=float, help="per shard: a fraction in (0, 1] or bytes")
    parser.add_argument("--prefill-replicas", type=int)
    parser.add_argument("--decode-replicas", type=int)
    parser.add_argument("--prefill-tp", type=int, help="tensor-parallel degree of each prefill replica")
    parser.add_argument("--decode-tp", type=int, help="tensor-parallel degree of each decode replica")
    parser.add_argument("--replicas", type=int, help="colocated mode: replicas of the one pool")
    parser.add_argument(
        "--prefill-cores", type=int, help="CPU cores per prefill replica (default: its share of the host)"
    )
    parser.add_argument(
        "--decode-cores", type=int, help="CPU cores per decode replica (default: its share of the host)"
    )
    parser.add_argument(
        "--cores", type=int, help="colocated mode: CPU cores per replica (default: the host's, divided by the replicas)"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config key, dotted")
    keys = parser.add_argument_group(
        "every config key",
        "each key of the config file is a flag too: --KEY-NAME VALUE, a section's --SECTION.KEY-NAME VALUE "
        "(--block-size 32, --router.request-timeout-s 60, --prefill.max-num-seqs 32; booleans: --planner.enabled "
        "or --no-planner.enabled); --help-config lists them",
    )
    keys.add_argument("--help-config", action=ListConfigFlags, help="list every config key's flag and exit")
    add_config_flags(parser, FLAG_KEYS)


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags a `vllm serve` launch line uses, meaning what they mean there."""
    parser.add_argument(
        "--served-model-name", metavar="NAME", help="the model name clients send (default: derived from MODEL)"
    )
    parser.add_argument("--max-model-len", type=int, metavar="N", help="context length (default: the model's)")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        "--tp",
        type=int,
        metavar="N",
        help="tensor-parallel degree of every pool: the colocated one, or prefill and decode both "
        "(unless --prefill-tp / --decode-tp say otherwise)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="clients must send 'Authorization: Bearer KEY' (repeat for several keys); never logged",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="F",
        help="CUDA: the fraction of each GPU's total memory a shard may use, weights, activations and KV "
        "together (the KV cache gets the rest); refused on CPU, where --kv-cache-memory sizes it",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        help="a chat template file, or the template inline (replaces the model's)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV of shared prompt prefixes (default on)",
    )
    parser.add_argument("--revision", metavar="REV", help="the Hub id's branch, tag or commit (default: main)")
    parser.add_argument(
        "--allowed-origins",
        type=_origins,
        metavar="ORIGINS",
        help='CORS: web origins whose pages may call the API and read answers, a JSON list or commas ("*": any); '
        "default: none (loopback pages may call it but read nothing)",
    )
    parser.add_argument("--ssl-keyfile", metavar="PEM", help="HTTPS: the PEM private key (with --ssl-certfile)")
    parser.add_argument("--ssl-certfile", metavar="PEM", help="HTTPS: the PEM certificate (with --ssl-keyfile)")
    parser.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a log line per HTTP request in the router's log (default off)",
    )


def _origins(text: str) -> list[str]:
    """vLLM's JSON list (["https://a.example"]), or origins separated by commas."""
    if text.strip().startswith("["):
        try:
            origins = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
    else:
        origins = [part.strip() for part in text.split(",") if part.strip()]
    if not isinstance(origins, list) or not origins or not all(isinstance(o, str) for o in origins):
        raise argparse.ArgumentTypeError(f"{text!r}: give origins as a JSON list or separated by commas")
    return origins


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    model_tag = getattr(args, "model_tag", None)
    if model_tag is not None and args.model is not None and model_tag != args.model:
        raise ConfigError(f"two models given: {model_tag!r} and --model {args.model!r}; give one")
    if model_tag is not None:
        args.model = model_tag
    overrides: dict[str, Any] = {}
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is not None:
            if flag == "kv_cache_memory" and value > 1:
                value = int(value)
            overrides[key] = value
    overrides.update(config_overrides(args))
    for item in args.set:
        key, value = parse_override(item)
        overrides[key] = value
    return load_cluster_config(args.config, overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster import app

    config = app.resolved(config_from_args(args))
    wrote_state = False

    def _terminate(signum, frame):  # SIGTERM takes the same clean path as Ctrl-C
        raise KeyboardInterrupt

    try:
        seconds = app.deploy(config)
        signal.signal(signal.SIGTERM, _terminate)  # after ray.init, which installs a handler of its own
        # Also when started in the background by a script, where SIGINT arrives ignored.
        signal.signal(signal.SIGINT, _terminate)
        port = app.http_port(config)
        _write_state(config, port)
        wrote_state = True
        url = f"{_scheme(config.to_dict())}://{config.host}:{port}/v1"
        print(
            f"pdserve ({config.mode}) serving {config.served_name} at {url} "
            f"— ready in {seconds:.1f} s. Ctrl-C stops it.",
            flush=True,
        )
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        # A second Ctrl-C must not cut the shutdown short and leave Ray processes behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("pdserve: shutting down", flush=True)
        if wrote_state:  # a start refused (port taken) must not erase the running cluster's record
            env.run_state_file().unlink(missing_ok=True)
        app.shutdown()
    return 0


def _write_state(config: ClusterConfig, port: int) -> None:
    path = env.run_state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config.redacted_dict(), "port": port}))


def _scheme(config: dict) -> str:
    return "https" if config.get("router", {}).get("ssl_certfile") else "http"


def _read_state() -> dict:
    path = env.run_state_file()
    if not path.exists():
        raise ConfigError(f"no running pdserve found ({path} is missing); start one with `pdserve serve`")
    return json.loads(path.read_text())


def _router_url(args: argparse.Namespace) -> str:
    if args.url:
        return args.url.rstrip("/")
    state = _read_state()
    host = state["config"]["host"]
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"{_scheme(state['config'])}://{host}:{state['port']}"


def cmd_status(args: argparse.Namespace) -> int:
    url = _router_url(args) + "/pdserve/status"
    admin_key = os.environ.get(ADMIN_KEY_ENV, "").strip()
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            status = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise ConfigError(f"the router at {url} wants an admin key: set {ADMIN_KEY_ENV}") from None
        raise ConfigError(f"the router at {url} answered {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ConfigError(f"cannot reach the router at {url}: {exc}") from None
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"mode {status['mode']}  model {status['model']}  in flight {status['in_flight']}")
    print(
        f"{'pool':<10} {'replica':<12} {'cores':<8} {'running':>7} {'waiting':>7} {'reserved':>8} "
        f"{'KV used':>8} {'held':>5}  processes (rank 0, shards)"
    )
    for pool, reports in status["pools"].items():
        for r in reports:
            used = 1 - r["num_kv_blocks_free"] / r["num_kv_blocks_total"] if r["num_kv_blocks_total"] else 0.0
            print(
                f"{pool:<10} {r['replica_id']:<12} {_cores_text(r):<8} {r['num_running']:>7} {r['num_waiting']:>7} "
                f"{r['num_reserved']:>8} {used:>7.0%} {r['num_blocks_held']:>5}  {_pids_text(r)}"
            )
            if r.get("engine_error"):  # Serve's health check replaces it; until then placement skips it
                print(f"{'':<10} ^ engine stopped: {r['engine_error'][:160]}")
    metrics = status.get("metrics", {})
    medians = ", ".join(
        f"{name} {metrics[key] * 1e3:.0f} ms"
        for name, key in (("TTFT", "ttft_median_s"), ("TPOT", "tpot_median_s"), ("E2E", "e2e_median_s"))
        if metrics.get(key) is not None
    )
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(metrics.get("outcomes", {}).items()))
    print(
        f"recent medians: {medians or '-'}; outcomes: {outcomes or '-'}; retries {status.get('retries', 0)}, "
        f"resumes {status.get('resumes', 0)}"
    )
    return 0


def _pids_text(report: dict) -> str:
    return ",".join(str(pid) for pid in [report.get("pid", 0), *report.get("shard_pids", [])] if pid) or "-"


def _cores_text(report: dict) -> str:
    """``0-1``; ``1*`` marks a core shared with another replica; ``-``: unpinned (CUDA, remote)."""
    cores = report.get("cpu_cores") or []
    if not cores:
        return "-"
    shared = set(report.get("cpu_cores_shared") or [])
    owned = format_core_list([c for c in cores if c not in shared])
    return ",".join(filter(None, [owned, *(f"{c}*" for c in sorted(shared))]))


def parse_scale(items: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        pool, sep, value = item.partition("=")
        if not sep or pool not in ("prefill", "decode", "colocated") or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"cannot read {item!r}: write pool=N with pool prefill, decode or colocated and N >= 1")
        counts[pool] = int(value)
    if not counts:
        raise ConfigError("say what to scale, e.g. `pdserve scale prefill=2 decode=1`")
    return counts


def cmd_scale(args: argparse.Namespace) -> int:
    """Through the router's admin endpoint (POST /pdserve/scale, PDSERVE_ADMIN_KEY): an operator
    needs the router's port and the admin key, not access to Ray."""
    counts = parse_scale(args.pools)
    url = _router_url(args) + "/pdserve/scale"
    status, answer = _admin_post(url, counts, timeout_s=SCALE_TIMEOUT_S)
    if status != 200:
        message = answer.get("error", {}).get("message", answer) if isinstance(answer, dict) else answer
        raise ConfigError(f"the router at {url} refused the scale ({status}): {message}")
    print("scaled: " + ", ".join(f"{pool}={n}" for pool, n in answer["replicas"].items()))
    return 0


# A resize waits for Serve to start the new replicas (a model load each) or drain the old ones.
SCALE_TIMEOUT_S = 900.0


def _admin_post(url: str, body: dict, timeout_s: float) -> tuple[int, Any]:
    admin_key = os.environ.get(ADMIN_KEY_ENV, "").strip()
    headers = {"content-type": "application/json"}
    if admin_key:
        headers["Authorization"] = f"Bearer {admin_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            why = f"refused the key in {ADMIN_KEY_ENV}" if admin_key else f"wants an admin key: set {ADMIN_KEY_ENV}"
            raise ConfigError(f"the router at {url} {why}") from None
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {}
    except (urllib.error.URLError, OSError) as exc:
        raise ConfigError(f"cannot reach the router at {url}: {exc}") from None


def add_subcommands(sub: Any) -> None:
    serve_parser = sub.add_parser("serve", help="run the cluster: router + pools on Ray Serve (OpenAI API)")
    add_serve_arguments(serve_parser)
    serve_parser.set_defaults(func=cmd_serve)

    status = sub.add_parser("status", help="each pool's replicas with their load and KV usage")
    status.add_argument("--url", help="router URL (default: the running `pdserve serve`)")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    scale = sub.add_parser("scale", help="resize pools of the running cluster, e.g. prefill=2 decode=1")
    scale.add_argument("pools", nargs="+", metavar="POOL=N")
    scale.add_argument("--url", help="router URL (default: the running `pdserve serve`)")
    scale.set_defaults(func=cmd_scale)
