"""pdserve's log lines in every process it runs in: the CLI, Serve replicas, TP shard actors.

Ray's worker processes configure no logging (Python's default: WARNING and up, through the
last-resort handler), so a replica's INFO lines ("decode replica ... ready", the CPU kernels and
layer stack it chose, CUDA graphs captured) were dropped. Ray forwards a worker's stderr to its
log file and, for a local cluster, to the driver's terminal.
"""

from __future__ import annotations

import logging

from common import env

# The top-level packages whose loggers (logging.getLogger(__name__)) are pdserve's.
PACKAGES = ("bench", "cluster", "common", "decode_pool", "engine", "kv_transfer", "prefill_pool", "router")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | None = None) -> None:
    """pdserve's loggers at ``level`` (PDSERVE_LOG_LEVEL, INFO by default); a stderr handler on the
    root logger where the process has none. Idempotent; a process that configured its own
    handlers (the CLI's basicConfig, pytest's capture) keeps them."""
    level = level or env.log_level()
    for name in PACKAGES:
        logging.getLogger(name).setLevel(level)
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()  # stderr
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
