"""Every environment variable pdserve reads, in one place, all prefixed ``PDSERVE_``."""

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


def direct_ingress_enabled() -> bool:
    """PDSERVE_DIRECT_INGRESS=0: a local cluster's clients come through Serve's HTTP proxy, as on a
    joined Ray cluster, instead of to the router replica's own HTTP server."""
    return os.environ.get("PDSERVE_DIRECT_INGRESS", "1") not in ("0", "false", "no", "off")


def cpu_kernels_enabled() -> bool:
    """PDSERVE_CPU_KERNELS=0 keeps the engine on plain torch ops (the compiled CPU kernels are off)."""
    return os.environ.get("PDSERVE_CPU_KERNELS", "1") not in ("0", "false", "no", "off")


def cpu_auto_dtype() -> str | None:
    """PDSERVE_CPU_AUTO_DTYPE=float32|bfloat16 pins what dtype=auto means on CPU (unset: probe the
    machine's matmul speed at start-up). The test suite pins float32, the oracle's dtype."""
    value = os.environ.get("PDSERVE_CPU_AUTO_DTYPE", "").strip().lower()
    return value if value in ("float32", "bfloat16") else None


def core_lock_dir() -> Path:
    """Where replicas lock the CPU cores they own, one file per core (PDSERVE_CORE_LOCK_DIR, else
    /dev/shm/pdserve-cores, host-wide: two clusters on one host do not share cores either)."""
    configured = os.environ.get("PDSERVE_CORE_LOCK_DIR")
    if configured:
        return Path(configured).expanduser()
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else cache_dir()) / "pdserve-cores"
