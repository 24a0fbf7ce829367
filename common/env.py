"""Every environment variable pdserve reads, in one place, all prefixed ``PDSERVE_``; and the ones it sets
for the Ray processes of a local cluster (``SERVE_PROCESS_ENV``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted model checkpoints are kept (PDSERVE_CACHE_DIR, else ~/.cache/pdserve)."""
    configured = os.environ.get("PDSERVE_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve"


def log_level() -> str:
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()


def run_state_file() -> Path:
    """Where a running ``pdserve serve`` records its configuration, for ``status`` and ``scale``."""
    configured = os.environ.get("PDSERVE_STATE_FILE")
    return Path(configured).expanduser() if configured else cache_dir() / "run" / "cluster.json"


def cpu_kernels_enabled() -> bool:
    """PDSERVE_CPU_KERNELS=0 keeps the engine on plain torch ops (the compiled CPU kernels are off)."""
    return os.environ.get("PDSERVE_CPU_KERNELS", "1") not in ("0", "false", "no", "off")


def prefill_attention() -> str | None:
    """PDSERVE_PREFILL_ATTENTION=tiled|sdpa pins which prefill attention the CPU kernels' layer loop
    runs (unset: the faster on this machine, probed at start-up: engine.cpu_kernels.prefill_probe)."""
    value = os.environ.get("PDSERVE_PREFILL_ATTENTION", "").strip().lower()
    return value if value in ("tiled", "sdpa") else None


def cpu_auto_dtype() -> str | None:
    """PDSERVE_CPU_AUTO_DTYPE=float32|bfloat16 pins what dtype=auto means on CPU (unset: probe the
    machine's matmul speed at start-up). The test suite pins float32, the oracle's dtype."""
    value = os.environ.get("PDSERVE_CPU_AUTO_DTYPE", "").strip().lower()
    return value if value in ("float32", "bfloat16") else None


def host_id() -> str | None:
    """PDSERVE_HOST_ID names this host for the KV transports' same-host check (unset: the kernel's
    boot id). Set it per Ray node to make two nodes of one machine count as two hosts, as a test of
    a multi-node cluster does: KV between them then leaves over the network, as between machines."""
    return os.environ.get("PDSERVE_HOST_ID") or None


def core_lock_dir() -> Path:
    """Where replicas lock the CPU cores they own, one file per core (PDSERVE_CORE_LOCK_DIR, else
    /dev/shm/pdserve-cores, host-wide: two clusters on one host do not share cores either)."""
    configured = os.environ.get("PDSERVE_CORE_LOCK_DIR")
    if configured:
        return Path(configured).expanduser()
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else cache_dir()) / "pdserve-cores"


# The environment of a local cluster's Ray processes, read by them at start-up (a user's own
# setting of any of them wins). Every streamed token crosses Serve's hops, and on CPU each hop's
# work is taken from the engine's cores: a 64-request burst (64 × 256/64) ran at 56% of the
# offline engine's rate with Serve's defaults.
SERVE_PROCESS_ENV = {
    # Ray starts its workers at nice 15; the replicas are the server, not background work: at the
    # default 15 any process on the host (a load client, a build) takes their cores first.
    "RAY_worker_niceness": "0",
    # Serve's throughput settings: gRPC between deployments, user code on each replica's own event
    # loop, access logs written in batches, the GC frozen after start-up. Measured with `pdserve
    # bench router` (null pools, 64 tokens a request): CPU per token 0.75 -> 0.37 ms in the pool
    # replica, 1.7 -> 1.2 ms in the router. Logs still go to stderr.
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_LOG_TO_STDERR": "1",
    # Those settings turn Serve's direct ingress on too; the router serves HTTP itself instead
    # (router.http_listener says why).
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
}


# Hugging Face's own variables (not PDSERVE_: a vLLM user has them set already), read here at call
# time: huggingface_hub reads them once, at its import, which a test or a long-lived process may
# have done before they were set.
def hf_hub_offline() -> bool:
    """HF_HUB_OFFLINE=1: models by Hub id come from the local Hugging Face cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hf_hub_cache() -> Path:
    """The Hugging Face cache of Hub downloads: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub (huggingface_hub's own order)."""
    configured = os.environ.get("HF_HUB_CACHE")
    if configured:
        return Path(configured).expanduser()
    home = os.environ.get("HF_HOME") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    )
    return Path(home).expanduser() / "hub"
