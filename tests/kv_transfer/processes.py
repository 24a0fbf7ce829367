"""Peers in real child processes for the kill drills: a Python script that talks over stdout."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def spawn_python(script: str, *args: str) -> subprocess.Popen:
    """``python -c script args`` with this repository importable, stdin and stdout piped as text."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def read_line(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """One line of the child's stdout, or fail (never hang) if it does not come."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not box or not box[0]:
        proc.kill()
        pytest.fail(f"child process gave no output within {timeout_s}s (exit code {proc.poll()})")
    return box[0].strip()
