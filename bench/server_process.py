"""Start and stop a real ``pdserve serve`` as a child process, the way a user runs it.

The benchmarks talk to it over HTTP only (bench sits below cluster/ in the layering and uses the
public entry point), and time its start-up from launch to "ready".
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    startup_s: float
    log: list[str]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self, timeout_s: float = 120.0) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def start_server(
    serve_args: list[str], timeout_s: float = 600.0, port: int | None = None, env: dict[str, str | None] | None = None
) -> ServerProcess:
    """``pdserve serve <serve_args>`` on ``port`` (default: a free one); returns once it prints
    that it is ready. ``env``: variables to set in its environment (None: to unset)."""
    port = port or free_port()
    state = Path(tempfile.mkdtemp(prefix="pdserve-bench-")) / "cluster.json"
    changes = {"PDSERVE_STATE_FILE": str(state), **(env or {})}
    env = {name: value for name, value in {**os.environ, **changes}.items() if value is not None}
    command = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), *serve_args]
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    log: list[str] = []
    ready = threading.Event()

    def read() -> None:  # keep draining: a full pipe would stall the server
        assert process.stdout is not None
        for line in process.stdout:
            log.append(line)
            del log[:-200]  # bounded
            if "ready in" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    while not ready.wait(0.5):
        if process.poll() is not None or time.monotonic() - started > timeout_s:
            if process.poll() is None:
                process.kill()
            raise RuntimeError(f"pdserve serve {' '.join(serve_args)} did not start:\n{''.join(log[-40:])}")
    return ServerProcess(process, port, time.monotonic() - started, log)
