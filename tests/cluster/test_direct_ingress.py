"""`pdserve serve` with PDSERVE_DIRECT_INGRESS=1: the router replica is the HTTP server (Serve's direct ingress).

The other serving tests deploy many configurations into one Ray behind Serve's proxy (the
default); this module starts the real command, with its defaults but float32 and a small KV
budget, and checks what changes when clients reach the router directly: who listens on the
port, greedy output against transformers, request ids, and a client that leaves mid-stream.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from pathlib import Path

import pytest

from bench.server_process import start_server
from tests.cluster.serving import MODEL, get_json
from tests.conftest import PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PDSERVE_DIRECT_INGRESS", "1")  # opt-in (cluster.app.direct_ingress_env says why)
        process = start_server(["--dtype", "float32", "--kv-cache-memory", str(32 * 2**20)])
    yield process
    process.stop()


def _listener_process(port: int) -> str:
    """The command line of the process listening on ``port`` (read from /proc)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # local address, state LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
    return ""


def _post(port: int, body: dict, headers: dict | None = None) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json", **(headers or {})}
    )
    return connection.getresponse()


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="finds the listener through /proc")
def test_clients_reach_the_router_replica_itself_not_a_proxy_in_front_of_it(server):
    assert "ServeReplica:pdserve:router" in _listener_process(server.port)


def test_greedy_output_through_the_router_s_own_server_matches_transformers(server, smol_dir, hf_smol, hf_reference):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smol_dir))
    for prompt in PROMPTS[:2]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = _post(server.port, body, {"X-Request-Id": "direct-1"})
        payload = json.loads(response.read())
        assert response.status == 200 and response.headers["x-request-id"] == "direct-1", payload
        want = tokenizer.decode(hf_reference(hf_smol, tokenizer.encode(prompt), MAX_TOKENS), skip_special_tokens=True)
        assert payload["choices"][0]["text"] == want


def test_a_client_gone_mid_stream_leaves_nothing_held_and_bad_input_is_a_400(server):
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    response = _post(server.port, body)
    assert response.status == 200
    response.read1(64)
    response.close()  # the client leaves with ~190 tokens to go
    bad = _post(server.port, {"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert bad.status == 400 and "error" in json.loads(bad.read())
    deadline = time.monotonic() + 60
    while True:
        status = get_json(f"http://127.0.0.1:{server.port}/pdserve/status")
        held = [r["num_blocks_held"] for pool in status["pools"].values() for r in pool]
        if status["in_flight"] == 0 and not any(held):
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.5)


def test_a_port_still_taken_fails_the_start_with_a_clear_error_and_a_free_one_passes():
    """Serve gives the router's port up for good on a failed bind, so start_ray checks it first."""
    import socket

    from cluster.app import wait_port_free
    from common.errors import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve on 127.0.0.1:{port}"):
            wait_port_free("127.0.0.1", port, timeout_s=0.5)
    wait_port_free("127.0.0.1", port, timeout_s=5)  # closed: free again at once
