"""A real local Ray + Serve cluster for the serving tests, redeployed only when the config changes."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

from bench.server_process import free_port
from cluster import app
from cluster.cluster_config import ClusterConfig, load_cluster_config

MODEL = "SmolLM2-135M-Instruct"
# Small KV budgets keep start-up quick; 16 MiB still holds ~350 tokens per shard of SmolLM2.
# Payloads are checked as shipped (kv_integrity's default, the keyed MAC): a corrupted transfer
# must fail loudly here.
# Disaggregated deployments here move every prompt's KV (the transports are what they test) unless
# a test turns conditional disaggregation on itself.
BASE = {
    "mode": "disagg",
    "kv_cache_memory": 32 * 2**20,
    "dtype": "float32",
    "router.kv_lease_s": 30.0,
    "router.conditional_disaggregation": False,
    "health_check_period_s": 1.0,  # the shard drills wait for Serve to replace a failed replica
}


def get_json(url: str, timeout: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def post(url: str, body: bytes | dict, headers: dict | None = None, timeout: float = 120.0):
    """(status, headers, parsed JSON body) of a POST; HTTP errors are returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only whether the process exists (same host)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalCluster:
    def __init__(self) -> None:
        self.port = free_port()
        self.config: ClusterConfig | None = None
        self.started = False
        self.startup_s: dict[str, float] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ensure(self, **overrides: Any) -> ClusterConfig:
        """Deploy the config (BASE + overrides) unless it is the one running."""
        # As `pdserve serve` deploys it: each replica owns its share of the host's cores.
        config = app.with_resolved_cores(load_cluster_config(None, {**BASE, **overrides, "port": self.port}))
        if config == self.config:
            return config
        started = time.monotonic()
        if not self.started:
            app.start_ray(config)
            app.start_serve(config)
            self.started = True
        self.deploy(config)
        self.startup_s[json.dumps(overrides, sort_keys=True)] = time.monotonic() - started
        return config

    def deploy(self, config: ClusterConfig) -> None:
        app.run_app(config)
        app.wait_ready(300)
        self.config = config
        self.wait_healthy()

    def scale(self, **counts: int) -> dict:
        """Resize pools through the router's admin endpoint, as `pdserve scale` does."""
        code, _, answer = post(self.url + "/pdserve/scale", counts, timeout=600)
        assert code == 200, answer
        assert self.config is not None
        self.config = app.scaled(self.config, counts)
        return answer["replicas"]

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if get_json(self.url + "/health", timeout=15)["status"] == "ok":
                    return
            except (urllib.error.URLError, OSError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster did not become healthy")
            time.sleep(0.5)

    def status(self) -> dict:
        return get_json(self.url + "/pdserve/status")

    def metric(self, name: str, label: str = "") -> float:
        """The router's metric ``name`` (summed over its series whose labels contain ``label``)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            lines = response.read().decode().splitlines()
        series = [line for line in lines if line.startswith(name + "{") and label in line.partition("}")[0]]
        return sum(float(line.rsplit(" ", 1)[1]) for line in series)

    def wait_idle(self, timeout_s: float = 60.0) -> dict:
        """Poll until nothing is in flight, every replica of every pool holds zero request blocks,
        and each pool has its configured number of replicas, every process of them alive (a killed
        one replaced): the cluster is whole and idle again within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            reports = [r for pool in status["pools"].values() for r in pool]
            whole = all(
                len(status["pools"].get(pool, [])) == self.config.pool(pool).replicas for pool in self.config.pools()
            ) and all(r["pid"] > 0 and all(map(_alive, [r["pid"], *r["shard_pids"]])) for r in reports)
            busy = (
                not whole
                or status["in_flight"]
                or any(
                    r["num_blocks_held"]
                    or r["num_running"]
                    or r["num_waiting"]
                    or r["num_reserved"]
                    or r.get("num_waiting_for_blocks")
                    for r in reports
                )
            )
            if not busy:
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"the pools did not drain: {status}")
            time.sleep(0.5)

    def shutdown(self) -> None:
        if self.started:
            app.shutdown()
