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
