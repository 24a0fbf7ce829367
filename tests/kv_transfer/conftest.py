from __future__ import annotations

import subprocess

import pytest

from tests.kv_transfer.harness import release_regions
from tests.kv_transfer.processes import spawn_python


@pytest.fixture(autouse=True)
def _release_shared_caches():
    """Each test's shared caches: their descriptors closed and unregistered (views stay valid)."""
    yield
    release_regions()


@pytest.fixture
def spawn():
    """Starts child Python processes (``spawn_python``); kills whatever is left at the end of the test."""
    procs: list[subprocess.Popen] = []

    def start(script: str, *args: str) -> subprocess.Popen:
        procs.append(spawn_python(script, *args))
        return procs[-1]

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(10)
