"""Network faults between the pools: two Ray nodes in two network namespaces joined by a veth pair,
the prefill pool on one, the decode pool on the other, so that every KV byte and every call between
the pools crosses a link the test can slow, make lossy or cut.

    node-a  (this namespace)   10.213.N.1   Ray head, the router, the prefill replica
    node-b  (its own netns)    10.213.N.2   Ray worker, the decode replica and its tcp KV listener

Faults, each on the link from node-a to node-b (what prefill sends decode), in turn:

    slow and lossy   tbf at 100 Mbit/s plus 2% of packets dropped at random (iptables statistic)
    KV port cut      every connection to the decode replica's KV port goes silent after its first
                     256 KiB (iptables connbytes): a push dropped mid-way, by a link that says nothing

Promised, and asserted: every answer equals transformers' (a slow, lossy link only slows the
hand-off; a cut one fails it within its deadline, and the prompt is computed on decode, as
router.kv_load_failure_policy=recompute says); the cut shows as failed transfers, and no request
fails; once the link is whole again the next hand-offs go through; no replica holds a block.

netem (delay, jitter) is not in every kernel: this machine's has no sch_netem
(CONFIG_NET_SCH_NETEM unset), so the added delay here is the slow link's queueing. Needs root, ip,
tc, iptables and ss (iproute2 and iptables, which `make chaos` installs where missing).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import shutil
import subprocess
import tempfile
import time
import urllib.request

import pytest

from bench.server_process import start_server
from tests.cluster.serving import MODEL, free_port, get_json, post
from tests.cluster.test_multinode import _MARKER, _RAY, _TOKEN_AUTH, _stop_nodes
from tests.conftest import PROMPTS, long_text

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(1200)]
MAX_TOKENS = 6
TOOLS = ("ip", "tc", "iptables", "ss")


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stderr.strip()}"
    return done.stdout


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    return f"missing {', '.join(absent)} (make chaos installs iproute2 and iptables)" if absent else None


class Link:
    """A veth pair between this namespace and a new one, and the faults put on its node-a end."""

    def __init__(self) -> None:
        tag = f"{random.randrange(16**6):06x}"
        self.netns, self.veth_a, self.veth_b = f"pdn-{tag}", f"pda{tag}", f"pdb{tag}"
        subnet = random.randrange(256)
        self.ip_a, self.ip_b = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
        self.chain = f"PDSERVE-{tag}"
        _run("ip", "netns", "add", self.netns)
        _run("ip", "link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b, "netns", self.netns)
        _run("ip", "addr", "add", f"{self.ip_a}/30", "dev", self.veth_a)
        _run("ip", "link", "set", self.veth_a, "up")
        _run("ip", "-n", self.netns, "addr", "add", f"{self.ip_b}/30", "dev", self.veth_b)
        _run("ip", "-n", self.netns, "link", "set", self.veth_b, "up")
        _run("ip", "-n", self.netns, "link", "set", "lo", "up")
        # The faults' own chain, jumped to from OUTPUT for this veth only: removed whole at the end.
        _run("iptables", "-N", self.chain)
        _run("iptables", "-I", "OUTPUT", "-o", self.veth_a, "-j", self.chain)
        self.conntrack_acct = _run("sysctl", "-n", "net.netfilter.nf_conntrack_acct").strip()
        _run("sysctl", "-q", "-w", "net.netfilter.nf_conntrack_acct=1")  # connbytes counts bytes

    def slow_and_lossy(self, rate: str = "50mbit", loss: float = 0.03) -> None:
        shaping = ("tbf", "rate", rate, "burst", "64kb", "latency", "200ms")
        _run("tc", "qdisc", "replace", "dev", self.veth_a, "root", *shaping)
        lose = ("-m", "statistic", "--mode", "random", "--probability", str(loss), "-j", "DROP")
        _run("iptables", "-A", self.chain, *lose)

    def cut_after(self, port: int, nbytes: int) -> None:
        _run(
            "iptables", "-A", self.chain, "-p", "tcp", "--dport", str(port), "-m", "connbytes",
            "--connbytes", f"{nbytes}:", "--connbytes-dir", "original", "--connbytes-mode", "bytes", "-j", "DROP",
        )  # fmt: skip

    def heal(self) -> None:
        _run("iptables", "-F", self.chain)
        with contextlib.suppress(AssertionError):
            _run("tc", "qdisc", "del", "dev", self.veth_a, "root")

    def dropped_packets(self) -> int:
        rules = _run("iptables", "-L", self.chain, "-v", "-n", "-x").splitlines()[2:]
        return sum(int(line.split()[0]) for line in rules if line.strip())

    def close(self) -> None:
        for command in (
            ("iptables", "-D", "OUTPUT", "-o", self.veth_a, "-j", self.chain),
            ("iptables", "-F", self.chain),
            ("iptables", "-X", self.chain),
            ("ip", "link", "del", self.veth_a),
            ("ip", "netns", "del", self.netns),
            ("sysctl", "-q", "-w", f"net.netfilter.nf_conntrack_acct={self.conntrack_acct}"),
        ):
            subprocess.run(command, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def link():
    why = _missing()
    if why is not None:
        pytest.skip(why)
    made = Link()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def two_namespaces(link):
    """A Ray head on node-a and a worker raylet on node-b (in its namespace): the address to join."""
    temp_dir = tempfile.mkdtemp(prefix="pdf-", dir="/tmp")  # Ray's socket paths must fit in 107 bytes
    port = free_port()
    common = ["--num-cpus=2", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    head = [_RAY, "start", "--head", f"--port={port}", f"--node-ip-address={link.ip_a}", "--include-dashboard=false"]
    worker = ["ip", "netns", "exec", link.netns, _RAY, "start", f"--address={link.ip_a}:{port}"]
    worker.append(f"--node-ip-address={link.ip_b}")
    try:
        for host_id, command, resources in (
            ("node-a", head, '{"node_a": 4}'),
            ("node-b", worker, '{"node_b": 4}'),
        ):
            env = {**os.environ, **_TOKEN_AUTH, "PDSERVE_HOST_ID": host_id, _MARKER: temp_dir}
            started = subprocess.run(
                [*command, "--resources", resources, *common], env=env, capture_output=True, text=True, timeout=180
            )
            assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield f"{link.ip_a}:{port}"
    finally:
        _stop_nodes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def expected(greedy_text):
    return lambda prompt: greedy_text(prompt, MAX_TOKENS)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name) and not line.startswith("#"))


def _decode_kv_port(link: Link, decode_pid: int) -> int:
    """The decode replica's tcp KV listener: its one socket bound to node-b's own address."""
    listening = _run("ip", "netns", "exec", link.netns, "ss", "-Htlnp").splitlines()
    ports = [
        int(line.split()[3].rpartition(":")[2])
        for line in listening
        if line.split()[3].startswith(f"{link.ip_b}:") and f"pid={decode_pid}," in line
    ]
    assert len(ports) == 1, listening
    return ports[0]


def _wait_idle(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = get_json(url + "/pdserve/status")
        reports = [r for pool in status["pools"].values() for r in pool]
        busy = status["in_flight"] or any(
            r["num_blocks_held"] or r["num_running"] or r["num_waiting"] or r["num_reserved"] for r in reports
        )
        if not busy and len(reports) == 2:
            return
        assert time.monotonic() < deadline, status
        time.sleep(0.5)


def test_a_slow_lossy_link_and_a_kv_port_cut_mid_push_cost_time_not_answers(link, two_namespaces, expected, capsys):
    serve_args = [
        "--address", two_namespaces, "--mode", "disagg", "--dtype", "float32", "--kv-cache-memory", str(32 * 2**20),
        "--transport", "tcp", "--kv-host", "node",
        "--set", "prefill.ray_resources={node_a: 1}", "--set", "decode.ray_resources={node_b: 1}",
        "--set", "router.ray_resources={node_a: 0.01}",
        "--set", "router.conditional_disaggregation=false", "--set", "router.kv_lease_s=20",
    ]  # fmt: skip
    server = start_server(serve_args, timeout_s=300, env={**_TOKEN_AUTH, "PDSERVE_HOST_ID": None})
    try:
        url = f"http://127.0.0.1:{server.port}"
        deadline = time.monotonic() + 60
        while True:  # until both replicas' first reports (with their pids) reached the router
            pools = get_json(url + "/pdserve/status")["pools"]
            if all(len(pools.get(pool, [])) == 1 and pools[pool][0]["pid"] for pool in ("prefill", "decode")):
                break
            assert time.monotonic() < deadline, pools
            time.sleep(1)
        kv_port = _decode_kv_port(link, pools["decode"][0]["pid"])
        prompts = [f"{long_text(1)} {p}" for p in PROMPTS]
        figures = {}

        def one(prompt: str) -> str:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            code, _, answer = post(url + "/v1/completions", body, timeout=180)
            return answer["choices"][0]["text"] if code == 200 else f"{code}: {answer}"

        def serve_all(phase: str) -> None:
            """The prompts, at once; what it took, and how many attempts the router retried (a
            failed hand-off is retried with the prompt computed on decode)."""
            retries = get_json(url + "/pdserve/status")["retries"]
            failures = _metric(url, "pdserve:kv_transfer_failures")
            started = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(pool.map(one, prompts))
            assert answers == [expected(p) for p in prompts], (phase, answers)
            figures[phase] = {
                "seconds": round(time.monotonic() - started, 2),
                "retried": get_json(url + "/pdserve/status")["retries"] - retries,
                # From the replicas' reports, which reach the router a moment later: for the record.
                "failed_transfers": _metric(url, "pdserve:kv_transfer_failures") - failures,
            }

        serve_all("whole")
        link.slow_and_lossy()
        serve_all("slow_and_lossy")
        figures["slow_and_lossy"]["dropped_packets"] = link.dropped_packets()
        link.heal()
        link.cut_after(kv_port, 256 * 2**10)
        serve_all("kv_port_cut")
        figures["kv_port_cut"]["dropped_packets"] = link.dropped_packets()
        link.heal()
        serve_all("healed")
        with capsys.disabled():
            print(f"\nnetwork faults, {len(prompts)} prompts a phase: {figures}")

        assert figures["whole"]["retried"] == 0 and figures["whole"]["failed_transfers"] == 0
        assert figures["slow_and_lossy"]["dropped_packets"] > 0  # the link did lose packets...
        assert figures["slow_and_lossy"]["retried"] == 0  # ...and TCP made up for it: no hand-off failed
        assert figures["kv_port_cut"]["dropped_packets"] > 0
        assert figures["kv_port_cut"]["retried"] == len(prompts)  # each push cut, each prompt recomputed
        assert figures["healed"]["retried"] == 0  # once whole, hand-offs go through again
        _wait_idle(url)
    finally:
        link.heal()
        server.stop()
