"""pdserve's INFO lines reach stderr in a process that configured no logging (a Ray worker)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import logging
from common.logs import setup_logging
setup_logging()
setup_logging()  # a second call adds no second handler
logging.getLogger("engine.llm_engine").info("engine-info-line")
logging.getLogger("decode_pool.server").warning("pool-warning-line")
logging.getLogger("some_library").info("library-info-line")
"""


def _stderr(**env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "PDSERVE_LOG_LEVEL"} | env
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=environment, check=True, timeout=60
    )
    return done.stderr


def test_a_bare_process_logs_pdserve_info_once_and_leaves_other_libraries_at_warning():
    err = _stderr()
    assert err.count("engine-info-line") == 1 and " INFO engine.llm_engine: engine-info-line" in err
    assert err.count("pool-warning-line") == 1
    assert "library-info-line" not in err


def test_pdserve_log_level_is_honoured():
    err = _stderr(PDSERVE_LOG_LEVEL="warning")
    assert "engine-info-line" not in err and "pool-warning-line" in err
