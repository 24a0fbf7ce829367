"""`pdserve serve` as a user runs it: the router replica is the HTTP server (router.http_listener).

The other serving tests deploy many configurations into one Ray; this module starts the real
command, with its defaults but float32 and a small KV budget, and checks what the router's own
server must do: who listens on the port, greedy output against transformers, request ids, errors
in OpenAI's format, a client that leaves mid-stream, a second cluster refused on a taken port, and
a restart on the same port while the last one's connections sit in TIME_WAIT.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.server_process import start_server
from tests.cluster.serving import MODEL, get_json
from tests.conftest import PROMPTS

MAX_TOKENS = 12
SERVE_ARGS = ["--dtype", "float32", "--kv-cache-memory", str(32 * 2**20)]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server():
    process = start_server(SERVE_ARGS)
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


def _outcomes(port: int) -> dict:
    return get_json(f"http://127.0.0.1:{port}/pdserve/status")["metrics"]["outcomes"]


def _wait_idle(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = get_json(f"http://127.0.0.1:{port}/pdserve/status")
        held = [r["num_blocks_held"] for pool in status["pools"].values() for r in pool]
        if status["in_flight"] == 0 and not any(held):
            return
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="finds the listener through /proc")
def test_clients_reach_the_router_replica_itself_not_a_proxy_in_front_of_it(server):
    assert "ServeReplica:pdserve:router" in _listener_process(server.port)


def test_serve_without_a_mode_runs_what_auto_picks_for_this_host(server):
    from cluster.app import with_resolved_mode
    from cluster.cluster_config import load_cluster_config

    expected = with_resolved_mode(load_cluster_config()).mode  # colocated on a host of 2-3 cores
    assert get_json(f"http://127.0.0.1:{server.port}/health")["mode"] == expected
    pools = get_json(f"http://127.0.0.1:{server.port}/pdserve/status")["pools"]
    assert set(pools) == ({"colocated"} if expected == "colocated" else {"prefill", "decode"})


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
    _wait_idle(server.port)


def test_errors_are_openai_json_with_the_request_id_a_404_and_a_413_included(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("GET", "/v1/nothing-here", headers={"X-Request-Id": "lost-1"})
    response = connection.getresponse()
    payload = json.loads(response.read())
    assert response.status == 404 and response.headers["x-request-id"] == "lost-1"
    assert payload["error"]["type"] == "not_found_error" and "/v1/nothing-here" in payload["error"]["message"]

    # A 33 MiB body declared (over the 32 MiB limit): refused from its headers, none of it sent.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw:
        head = ["POST /v1/completions HTTP/1.1", "host: 127.0.0.1", f"content-length: {33 * 2**20}", "", ""]
        raw.sendall("\r\n".join(head).encode())
        response = http.client.HTTPResponse(raw)
        response.begin()
        payload = json.loads(response.read())
    assert response.status == 413 and payload["error"]["code"] == "request_too_large", payload
    assert response.headers["connection"] == "close"  # not read and dropped: 33 MiB declared


def test_a_second_cluster_on_the_same_port_is_refused_at_once_and_the_first_serves_on(server, tmp_path):
    started = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "serve", "--port", str(server.port), *SERVE_ARGS],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PDSERVE_STATE_FILE": str(tmp_path / "cluster.json")},
    )
    assert second.returncode != 0
    assert f"port {server.port} belongs to another pdserve on this host" in second.stdout + second.stderr
    assert not (tmp_path / "cluster.json").exists()
    assert time.monotonic() - started < 60  # refused before any Ray starts
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
    assert _post(server.port, body).status == 200


def test_a_client_gone_before_its_non_streamed_answer_cancels_the_request(server):
    """No proxy cancels the request for the router: the router itself watches for the disconnect."""
    before = _outcomes(server.port)
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 300, "ignore_eos": True}
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    connection.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    deadline = time.monotonic() + 60
    while get_json(f"http://127.0.0.1:{server.port}/pdserve/status")["in_flight"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # decoding now
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    _wait_idle(server.port)
    after = _outcomes(server.port)
    assert after.get("cancelled", 0) == before.get("cancelled", 0) + 1, (before, after)
    assert after.get("ok", 0) == before.get("ok", 0), "the request ran to max_tokens for nobody"


def _time_wait_on(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1].endswith(f":{port:04X}") and fields[3] == "06":  # local port, state TIME_WAIT
                return True
    return False


# Last in the module: it stops the module's server.
def test_a_restart_on_the_same_port_serves_although_old_connections_are_in_time_wait(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    want = json.loads(_post(server.port, body).read())["choices"][0]["text"]
    server.stop()  # the server closes its side first: its connections wait in TIME_WAIT (~60 s)
    assert _time_wait_on(server.port)  # what the restart must get past
    again = start_server(SERVE_ARGS, port=server.port, timeout_s=300)
    try:
        response = _post(again.port, body)
        assert response.status == 200 and json.loads(response.read())["choices"][0]["text"] == want
    finally:
        again.stop()
