"""Pools on two nodes of a Ray cluster: a head and a worker raylet started by `ray start` on this
machine, each with its own CPUs, a custom resource that pins one pool to it, and a host id of its
own (PDSERVE_HOST_ID), so that KV between them must leave over the network as between machines.
`pdserve serve --address` joins that cluster; greedy output equals transformers'."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bench.server_process import start_server
from tests.cluster.serving import MODEL, free_port, get_json, post
from tests.conftest import PROMPTS

_RAY = str(Path(sys.executable).with_name("ray"))
# `ray start --head` turns token authentication on (Ray 2.60); every process that joins the
# cluster, the worker raylet and pdserve's driver, must then present the token it wrote.
_TOKEN_AUTH = {"RAY_AUTH_MODE": "token"}
_MARKER = "PDSERVE_TEST_RAY_NODES"  # set on the raylets, inherited by every process they start


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _stop_nodes(marker: str, timeout_s: float = 30.0) -> None:
    """Kill this test's raylets and every process they started, and wait until none is left. Not
    `ray stop`, which would take every Ray on the machine (the other tests' local cluster too), nor
    by command line, which Ray rewrites in its workers (``ray::…``): by the variable each of them
    inherited from its raylet."""
    deadline = time.monotonic() + timeout_s
    while True:
        ours = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if _environ(int(entry.name)).get(_MARKER) == marker:
                        ours.append(int(entry.name))
        if not ours:
            return
        assert time.monotonic() < deadline, f"processes of the test's Ray nodes left: {ours}"
        for pid in ours:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)


@pytest.fixture(scope="module")
def two_nodes():
    # A short temp dir: Ray's socket paths must fit in 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="pdn-", dir="/tmp")
    port = free_port()
    # Both nodes on loopback: the head's GCS and the KV endpoints ("node" addresses) bind there.
    common = ["--num-cpus=2", "--node-ip-address=127.0.0.1", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    try:
        for host_id, extra in (
            ("node-a", ["--head", f"--port={port}", "--include-dashboard=false", "--resources", '{"node_a": 4}']),
            ("node-b", [f"--address=127.0.0.1:{port}", "--resources", '{"node_b": 4}']),
        ):
            env = {**os.environ, **_TOKEN_AUTH, "PDSERVE_HOST_ID": host_id, _MARKER: temp_dir}
            started = subprocess.run(
                [_RAY, "start", *extra, *common], env=env, capture_output=True, text=True, timeout=180
            )
            assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield f"127.0.0.1:{port}"
    finally:
        _stop_nodes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pools_on_two_nodes_hand_off_kv_over_the_network_and_match_transformers(
    two_nodes, tmp_path, smol_dir, hf_smol, hf_reference
):
    serve_args = [
        "--address", two_nodes, "--mode", "disagg", "--dtype", "float32", "--kv-cache-memory", str(32 * 2**20),
        "--transport", "auto", "--kv-host", "node",
        "--set", "prefill.ray_resources={node_a: 1}", "--set", "decode.ray_resources={node_b: 1}",
        "--set", "router.conditional_disaggregation=false", "--set", "kv_integrity=mac",
    ]  # fmt: skip
    server = start_server(serve_args, timeout_s=300, env={**_TOKEN_AUTH, "PDSERVE_HOST_ID": None})
    try:
        url = f"http://127.0.0.1:{server.port}"
        deadline = time.monotonic() + 60
        while True:  # until both replicas' first load reports (with their pids) reached the router
            pools = get_json(url + "/pdserve/status")["pools"]
            reports = pools.get("prefill", []) + pools.get("decode", [])
            if len(reports) == 2 and all(report["pid"] for report in reports):
                break
            assert time.monotonic() < deadline, pools
            time.sleep(1)
        # Each pool on its own node: the replica's process carries its raylet's host id.
        (prefill,), (decode,) = pools["prefill"], pools["decode"]
        assert _environ(prefill["pid"]).get("PDSERVE_HOST_ID") == "node-a"
        assert _environ(decode["pid"]).get("PDSERVE_HOST_ID") == "node-b"

        tokenizer = AutoTokenizer.from_pretrained(str(smol_dir))
        for prompt in PROMPTS[:3]:
            request = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            code, _, body = post(url + "/v1/completions", request)
            assert code == 200, body
            want = tokenizer.decode(hf_reference(hf_smol, tokenizer.encode(prompt), 8), skip_special_tokens=True)
            assert body["choices"][0]["text"] == want, prompt
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
        failures = [line for line in metrics.splitlines() if line.startswith("pdserve:kv_transfer_failures")]
        assert failures and all(line.rsplit(" ", 1)[1] in ("0", "0.0") for line in failures), failures
    finally:
        server.stop()
