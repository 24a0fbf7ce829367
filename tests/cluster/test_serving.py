"""The whole system on a real local Ray cluster, spoken to through the official OpenAI client.

Greedy output of the disaggregated cluster (prefill TP=3, decode TP=1, each KV transport) and of
the colocated one equals transformers' greedy output in float32, streamed and not; errors come
back in OpenAI's format with the right status, fuzzed requests included; nothing leaks KV blocks —
after errors, fuzzing, client disconnects, scaling, a decode or prefill replica, a prefill TP shard
or the router killed mid-request, and a burst past every queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings

from bench.oracle import hf_prompt_logprobs
from router.prefix_index import ROUTED_MEMORY_S
from tests.cluster.serving import MODEL, LocalCluster, get_json, post
from tests.conftest import PROMPTS, long_text
from tests.fuzz_requests import post_and_check, requests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster():
    local = LocalCluster()
    yield local
    local.shutdown()


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_dir))


@pytest.fixture(scope="module")
def expected(tokenizer, hf_smol, hf_reference):
    """transformers' greedy text for a prompt (completions) or a conversation (chat)."""

    def get(prompt: str, max_tokens: int = MAX_TOKENS, chat: bool = False) -> str:
        if chat:
            messages = [{"role": "user", "content": prompt}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = tokenizer.encode(prompt)
        return tokenizer.decode(hf_reference(hf_smol, list(ids), max_tokens), skip_special_tokens=True)

    return get


def client(cluster: LocalCluster, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=300, **kwargs)


def complete(api: openai.OpenAI, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> str:
    if not stream:
        response = api.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert response.usage.prompt_tokens > 0
        return response.choices[0].text
    chunks = api.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = [], None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        text.extend(choice.text for choice in chunk.choices)
    assert usage is not None and usage.completion_tokens > 0
    return "".join(text)


def chat(api: openai.OpenAI, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> str:
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        response = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
        return response.choices[0].message.content
    chunks = api.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


@contextlib.contextmanager
def long_prompts_in_flight(cluster: LocalCluster, expected, count: int, tag: str) -> Iterator[None]:
    """``count`` long prompts sent at once; the body runs once the router has handed every one of
    them to the prefill pool, while they are prefilling. On leaving, every one must have answered
    exactly (none refused or failed). Each starts with ``tag``: no prefix cache holds them, so they
    take the prefill pool seconds."""
    prompts = [f"{tag} {i}. {long_text(2)} Question {i}: what did the keepers do?" for i in range(count)]
    results: dict[int, str] = {}
    sent_to_prefill = cluster.metric("pdserve:prefill_site_total", 'site="remote"')

    def one(i: int) -> None:
        response = client(cluster).completions.create(model=MODEL, prompt=prompts[i], max_tokens=6, temperature=0)
        results[i] = response.choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while cluster.metric("pdserve:prefill_site_total", 'site="remote"') < sent_to_prefill + count:
        assert time.monotonic() < deadline, "the prompts never reached the prefill pool"
        time.sleep(0.02)
    try:
        yield
    finally:
        for t in threads:
            t.join()
    assert results == {i: expected(p, 6) for i, p in enumerate(prompts)}


def check_greedy(cluster: LocalCluster, expected) -> None:
    api = client(cluster)
    for prompt in PROMPTS[:3]:
        assert complete(api, prompt, stream=False) == expected(prompt)
        assert complete(api, prompt, stream=True) == expected(prompt)
    assert chat(api, PROMPTS[3], stream=False) == expected(PROMPTS[3], chat=True)
    assert chat(api, PROMPTS[3], stream=True) == expected(PROMPTS[3], chat=True)
    cluster.wait_idle()


# --- correctness, one deployment per layout ---------------------------------------------------
# Prompts in chunks of 16 tokens, each chunk's KV blocks pushed as it computes (not the CPU default).
DISAGG = {
    "mode": "disagg",
    "prefill.tensor_parallel_size": 3,
    "decode.tensor_parallel_size": 1,
    "prefill.max_prefill_chunk": 16,
    "kv_push_every_chunk": True,
}
# The tcp deployment also writes every process's spans to one file (a deployment fewer than a
# traced one of its own): the trace test finds its request's spans there by trace id.
TRACE_FILE = Path(tempfile.gettempdir()) / f"pdserve-test-spans-{os.getpid()}.jsonl"
TCP_TRACED = {**DISAGG, "transport": "tcp", "tracing": f"file:{TRACE_FILE}"}


def scrape(cluster: LocalCluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The router's /metrics, parsed by prometheus_client: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(cluster.url + "/metrics", timeout=30) as response:
        assert response.headers["content-type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def by_pool(samples: dict, name: str) -> dict[str, float]:
    """A per-replica series summed by pool."""
    totals: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        if sample == name:
            pool = dict(labels)["pool"]
            totals[pool] = totals.get(pool, 0.0) + value
    return totals


MODEL_LABEL = (("model_name", MODEL),)


def test_metrics_count_a_disaggregated_request_its_kv_transfer_and_each_pool_s_replicas(cluster, tokenizer):
    config = cluster.ensure(**TCP_TRACED)
    before = scrape(cluster)
    prompt = "Metrics: " + long_text(1)
    num_prompt = len(tokenizer.encode(prompt))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "stream": True}
    connection = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=120)
    connection.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.read().endswith(b"data: [DONE]\n\n")
    cluster.wait_idle()
    after = scrape(cluster)

    def grew(name: str, labels=MODEL_LABEL) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert grew("pdserve:time_to_first_token_seconds_count") == 1
    assert grew("pdserve:inter_token_latency_seconds_count") == 4
    assert grew("pdserve:e2e_request_latency_seconds_count") == 1
    assert grew("pdserve:request_success_total", (("finished_reason", "length"), *MODEL_LABEL)) == 1
    assert grew("pdserve:prompt_tokens_total") == num_prompt
    assert grew("pdserve:generation_tokens_total") == 5
    # Prefill's reply: its queue and prefill times, and the hand-off's bytes (every layer's K and V
    # of the prompt's blocks, all heads: float32 SmolLM2 is 30 layers x 3 KV heads x 64).
    assert grew("pdserve:request_prefill_time_seconds_count") == 1
    assert grew("pdserve:request_queue_time_seconds_count") == 1
    num_blocks = -(-num_prompt // config.block_size)
    assert grew("pdserve:kv_transfer_bytes_sum") == 30 * num_blocks * 2 * config.block_size * 3 * 64 * 4
    assert grew("pdserve:kv_transfer_seconds_count") == 1 and grew("pdserve:kv_transfer_exposed_seconds_count") == 1
    # The replicas' own series, one per replica of each pool, read from their reports. Those reach
    # the router with Serve's routing stats (every second), so the first scrape may predate them.
    queried_before = by_pool(before, "pdserve:prefix_cache_queries_total").get("prefill", 0.0)
    deadline = time.monotonic() + 30
    while by_pool(after, "pdserve:prefix_cache_queries_total").get("prefill", 0.0) <= queried_before:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
        after = scrape(cluster)
    queried = by_pool(after, "pdserve:prefix_cache_queries_total")
    assert set(queried) == {"prefill", "decode"} and queried["prefill"] > queried_before
    usage = by_pool(after, "pdserve:kv_cache_usage_perc")
    assert set(usage) == {"prefill", "decode"} and all(0 <= u <= 1 for u in usage.values())
    assert by_pool(after, "pdserve:kv_tickets_outstanding") == {"prefill": 0, "decode": 0}
    # The status page no longer lists the block hashes (they tell what other tenants' prompts hold).
    status = cluster.status()
    assert all("cached_blocks" not in r for pool in status["pools"].values() for r in pool)
    assert sum(r["num_cached_blocks"] for r in status["pools"]["prefill"]) >= num_blocks - 1


def test_cache_salt_keeps_each_tenant_s_prefix_cache_apart(cluster):
    cluster.ensure(**TCP_TRACED)
    prompt = "Salted: " + long_text(2)  # many blocks, new to this deployment

    def cached_tokens(**extra) -> int:
        status, _, payload = post(
            cluster.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
        )
        assert status == 200, payload
        return payload["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached_tokens(cache_salt="tenant-a") == 0
    assert cached_tokens(cache_salt="tenant-a") > 0  # the same tenant shares its prefix
    assert cached_tokens(cache_salt="tenant-b") == 0  # another tenant does not
    assert cached_tokens() == 0  # nor does a request without a salt
    assert cached_tokens() > 0
    status, _, payload = post(cluster.url + "/v1/completions", {"model": MODEL, "prompt": "x", "cache_salt": ""})
    assert status == 400 and payload["error"]["param"] == "cache_salt"
    cluster.wait_idle()


def test_one_trace_follows_a_request_from_the_client_through_router_prefill_kv_and_decode(cluster):
    path = TRACE_FILE
    cluster.ensure(**TCP_TRACED)
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    prompt = "Trace me: " + long_text(1)
    headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
    status, _, payload = post(
        cluster.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4}, headers
    )
    assert status == 200, payload
    cluster.wait_idle()
    wanted = {"pdserve.attempt", "pdserve.prefill", "pdserve.kv_transfer", "pdserve.decode", "pdserve.decode.generate"}
    deadline = time.monotonic() + 30
    while True:  # every process writes its spans as they end
        lines = path.read_text().splitlines() if path.exists() else []
        spans = [s for s in map(json.loads, lines) if s["context"]["trace_id"] == f"0x{trace_id}"]
        if wanted <= {s["name"] for s in spans} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    by_name = {s["name"]: s for s in spans}

    def parent_of(name: str) -> str:
        return next(n for n, s in by_name.items() if s["context"]["span_id"] == by_name[name]["parent_id"])

    request = by_name[f"text_completion {MODEL}"]
    assert request["parent_id"] == f"0x{client_span}" and request["kind"] == "SpanKind.SERVER"
    assert request["attributes"]["gen_ai.usage.output_tokens"] == 4
    assert parent_of("pdserve.attempt") == request["name"]
    assert parent_of("pdserve.prefill") == parent_of("pdserve.decode") == "pdserve.attempt"
    for name in ("pdserve.prefill.queue", "pdserve.prefill.chunk", "pdserve.kv_transfer"):
        assert parent_of(name) == "pdserve.prefill"
    for name in ("pdserve.decode.reserve", "pdserve.decode.kv_wait", "pdserve.decode.generate"):
        assert parent_of(name) == "pdserve.decode"
    services = {s["resource"]["attributes"]["service.name"] for s in spans}
    assert services == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    transfer = by_name["pdserve.kv_transfer"]
    assert transfer["attributes"]["pdserve.kv_bytes"] > 0
    # Pushed chunk by chunk: the transfer began before the prompt's last chunk did.
    chunks = sorted(s["start_time"] for s in spans if s["name"] == "pdserve.prefill.chunk")
    assert 2 <= transfer["attributes"]["pdserve.kv_windows"] <= len(chunks)
    assert transfer["start_time"] < chunks[-1]
    assert prompt[:40] not in path.read_text()  # prompt text is never recorded


def check_choices_and_prompt_logprobs(cluster: LocalCluster, tokenizer, hf_smol, expected, pool: str) -> None:
    """lm-eval's loglikelihood request and vLLM's prompt_logprobs equal transformers' log-softmax
    within 1e-4 in float32; n=3 with a seed is three choices, reproducible, streamed with their
    indices, the later two taking the prompt's blocks from ``pool``'s prefix cache; a batch of
    prompts answers each as alone; nothing is left held."""
    api = client(cluster)
    prompt = " ".join(PROMPTS[:3])  # over 16 tokens: scored across prompt chunks where chunks are 16
    ids = tokenizer.encode(prompt)
    reference = hf_prompt_logprobs(hf_smol, ids, 2)
    loglikelihood = api.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0
    ).choices[0]
    assert loglikelihood.text.startswith(prompt)
    scores = loglikelihood.logprobs.token_logprobs
    assert len(scores) == len(ids) + 1 and scores[0] is None
    assert max(abs(got - want) for got, (want, _) in zip(scores[1 : len(ids)], reference, strict=True)) < 1e-4
    assert loglikelihood.logprobs.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    fielded = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    entries = fielded.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for token_id, entry, (want, top) in zip(ids[1:], entries[1:], reference, strict=True):
        assert abs(entry[str(token_id)]["logprob"] - want) < 1e-4
        assert [int(k) for k, v in sorted(entry.items(), key=lambda kv: kv[1]["rank"]) if v["rank"] <= 2] == top

    before = by_pool(scrape(cluster), "pdserve:prefix_cache_hits_total").get(pool, 0.0)
    choices_prompt = "Choices, salted apart: " + " ".join(PROMPTS[1:4])
    params = {"model": MODEL, "prompt": choices_prompt, "n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 8}
    first = api.completions.create(**params)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) == 3 and texts == [c.text for c in api.completions.create(**params).choices]
    streamed: dict[int, str] = {}
    for chunk in api.completions.create(**params, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == texts
    full_blocks = len(tokenizer.encode(choices_prompt)) // 16 * 16
    deadline = time.monotonic() + 15  # the replicas report every second
    while by_pool(scrape(cluster), "pdserve:prefix_cache_hits_total").get(pool, 0.0) - before < 2 * full_blocks:
        assert time.monotonic() < deadline, "the later choices did not take the prompt's blocks from the cache"
        time.sleep(0.5)

    batch = api.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [expected(p) for p in PROMPTS[:2]]
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[3]}], n=2, max_tokens=MAX_TOKENS, temperature=0
    )
    assert [c.message.content for c in chat.choices] == [expected(PROMPTS[3], chat=True)] * 2
    cluster.wait_idle()


def test_disaggregated_choices_and_prompt_logprobs_as_a_vllm_client_asks_them(cluster, tokenizer, hf_smol, expected):
    cluster.ensure(**TCP_TRACED)  # prefill TP=3, chunks of 16: the prompt is scored over steps and shards
    check_choices_and_prompt_logprobs(cluster, tokenizer, hf_smol, expected, "decode")


def test_disaggregated_structured_outputs_and_tool_calls(cluster):
    cluster.ensure(**TCP_TRACED)  # the prefill replica samples the first token, decode resumes its matcher
    check_structured_outputs_and_tools(cluster, "hermes")
    # The request's span names the constraint's kind and the tool choice, never the schema.
    spans = [json.loads(line) for line in TRACE_FILE.read_text().splitlines()]
    kinds = {s["attributes"].get("pdserve.constraint.kind") for s in spans} - {None}
    assert {"json", "json_object", "regex", "choice", "grammar"} <= kinds
    assert {"required", "function"} <= {s["attributes"].get("pdserve.tool_choice") for s in spans}
    assert '"languages"' not in TRACE_FILE.read_text() and "maxLength" not in TRACE_FILE.read_text()


@pytest.mark.parametrize("transport", ["tcp", "grpc", "torch", "shm"])  # tcp: as the tests above, shm: below
def test_disaggregated_greedy_matches_transformers(cluster, expected, transport):
    cluster.ensure(**(TCP_TRACED if transport == "tcp" else {**DISAGG, "transport": transport}))
    check_greedy(cluster, expected)


def test_the_replicas_info_lines_reach_their_logs(cluster):
    """Ray's worker processes configure no logging: the replicas' INFO lines (their readiness, the
    kernels they chose) were dropped before common.logs."""
    import re

    import ray

    cluster.ensure(**DISAGG)
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())  # this driver's session
    text = "".join(path.read_text(errors="replace") for path in logs.glob("worker-*.err"))
    assert re.search(r" INFO decode_pool\.server: decode replica \S+ ready \(decode\)", text)
    assert re.search(r" INFO prefill_pool\.server: prefill replica \S+ ready", text)
    assert re.search(r" INFO engine\.", text)  # the engines' own start-up lines (kernels, layer stack)


# Ray's own daemons, which bind every interface whatever pdserve asks (docs/security.md, "What Ray exposes").
RAY_DAEMONS = (
    "gcs_server",
    "raylet",
    "dashboard/agent.py",
    "ray::DashboardAgent",
    "runtime_env/agent/main.py",
    "ray::RuntimeEnvAgent",
    "log_monitor.py",
    "monitor.py",
)


def _listeners_off_loopback() -> tuple[dict[int, list[str]], dict]:
    """This session's processes (this driver and its descendants: Ray's daemons, the replicas, their
    shards) -> their listening TCP sockets on any address but loopback."""
    import ipaddress

    import psutil

    me = psutil.Process()
    processes = {p.pid: p for p in [me, *me.children(recursive=True)]}
    found: dict[int, list[str]] = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in processes:
            continue
        if ipaddress.ip_address(conn.laddr.ip.split("%")[0]).is_loopback:
            continue
        found.setdefault(conn.pid, []).append(f"{conn.laddr.ip}:{conn.laddr.port}")
    return found, processes


def test_nothing_of_pdserve_listens_off_loopback(cluster):
    """A local cluster's sockets, listed: the router, the KV endpoints (auto: shm and tcp), the TP
    rendezvous stores and gloo pairs all bind 127.0.0.1. What is left off loopback is Ray's: its
    daemons, one gRPC port per Ray worker process (the core worker's: in every replica and shard and
    in this driver) and, in a Serve replica, Serve's inter-deployment gRPC server (ray.serve's
    replica.py binds "[::]:0" whatever the deployment asks)."""
    cluster.ensure(**DISAGG)
    assert complete(client(cluster), PROMPTS[0], stream=False)  # every listener is up
    found, processes = _listeners_off_loopback()
    replicas = 0
    for pid, addresses in found.items():
        command = " ".join(processes[pid].cmdline())
        if any(daemon in command for daemon in RAY_DAEMONS):
            continue
        of_ray = 1 + command.startswith("ray::ServeReplica")
        replicas += command.startswith("ray::ServeReplica:pdserve:")
        assert len(addresses) == of_ray, f"{command[:120]} listens off loopback on {addresses}"
    assert replicas >= 3  # the check saw the replicas' processes (router, prefill, decode)
    import psutil

    router = [
        c.laddr.ip for c in psutil.net_connections(kind="tcp") if c.status == "LISTEN" and c.laddr.port == cluster.port
    ]
    assert router == ["127.0.0.1"], router


def test_ray_s_services_refuse_a_client_without_the_cluster_s_token(cluster, tmp_path):
    """Ray's daemons listen on every interface (above), so what guards them is Ray's token
    authentication, on for a local cluster by default since Ray 2.52 (the token in
    ~/.ray/auth_token): a process that joins with the token is let in; one without it (a home with
    no token, authentication off on its side) is refused by the GCS itself."""
    import subprocess
    import sys

    import ray

    cluster.ensure(**DISAGG)
    gcs = ray.get_runtime_context().gcs_address
    join = "import ray, sys; ray.init(address=sys.argv[1]); print('JOINED', flush=True)"

    def joins(home: str, mode: str) -> tuple[bool, str]:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "HOME": home, "RAY_AUTH_MODE": mode}
        done = subprocess.run([sys.executable, "-c", join, gcs], env=env, capture_output=True, text=True, timeout=120)
        return done.returncode == 0 and "JOINED" in done.stdout, done.stderr[-3000:]

    joined, _ = joins(os.path.expanduser("~"), "token")
    assert joined, "the control: a process holding the token joins"
    joined, why = joins(str(tmp_path), "disabled")
    assert not joined and "InvalidAuthToken" in why, why  # the GCS's refusal, not the client's


# --- under load, errors, disconnects (prefill TP=3 → decode TP=1 over shared memory) ------------
def test_32_concurrent_streams_each_get_their_own_tokens(cluster, expected):
    cluster.ensure(**DISAGG, transport="shm")
    prompts = [f"{p} (variant {i})" for i in range(8) for p in PROMPTS]
    api = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(prompt: str) -> str:
        chunks = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    texts = asyncio.run(all_of_them())
    assert texts == [expected(p, 8) for p in prompts]
    cluster.wait_idle()


@pytest.mark.chaos
def test_a_burst_of_48_waits_for_kv_blocks_and_ends_with_no_error_and_nothing_leaked(cluster, expected):
    # 32 MiB a shard holds ~45 blocks of SmolLM2 in float32; 48 requests want ~96 at once, so most
    # decode reservations wait in the replica's FIFO for blocks to free instead of being refused.
    cluster.ensure(**DISAGG, transport="shm")
    prompts = [f"{p} (burst {i})" for i in range(12) for p in PROMPTS[:4]]
    api = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    most_waiting = 0

    async def one(prompt: str) -> str:
        chunks = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def watch(done: asyncio.Event) -> None:
        nonlocal most_waiting
        while not done.is_set():
            status = await asyncio.to_thread(cluster.status)
            waiting = sum(r["num_waiting_for_blocks"] for r in status["pools"].get("decode", []))
            most_waiting = max(most_waiting, waiting)
            await asyncio.sleep(0.2)

    async def burst() -> list[str]:
        done = asyncio.Event()
        watcher = asyncio.ensure_future(watch(done))
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            done.set()
            await watcher

    texts = asyncio.run(burst())  # any 503 or error event raises here
    want = {p: expected(p, 8) for p in set(prompts)}
    assert texts == [want[p] for p in prompts]
    assert most_waiting > 0, "the burst never queued for KV blocks: the test did not test the queue"
    cluster.wait_idle()  # no blocks held, nothing running, waiting or reserved on any replica


def test_errors_come_back_in_openai_format_and_leak_nothing(cluster):
    cluster.ensure(**DISAGG, transport="shm")
    url = cluster.url + "/v1/completions"
    cases = [
        (b"{not json", 400, None),
        # Each was a 500 once: a lone surrogate, an integer past Python's digit limit, deep nesting.
        (b'{"model": "%s", "prompt": "a \\ud800 b"}' % MODEL.encode(), 400, None),
        (b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (MODEL.encode(), b"9" * 5000), 400, None),
        (b"[" * 50_000 + b"]" * 50_000, 400, None),
        ({"model": "gpt-9", "prompt": "hi"}, 404, "model"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": ["a", [-1]]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
        ({"model": MODEL, "prompt": long_text(80)}, 400, "prompt"),  # past the context
        ({"model": MODEL, "prompt": ["hi", long_text(80)]}, 400, "prompt"),  # one prompt of a batch
        ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),  # past router.max_n
        ({"model": MODEL, "prompt": "hi", "priority": 1}, 400, "priority"),  # not the priority policy
    ]
    for body, status, param in cases:
        code, headers, payload = post(url, body, headers={"X-Request-Id": "req-err-1"})
        assert code == status, payload
        assert set(payload["error"]) == {"message", "type", "param", "code"} and payload["error"]["message"]
        assert payload["error"]["param"] == param
        assert headers.get("x-request-id") == "req-err-1"
    code, _, payload = post(url, {"model": MODEL, "prompt": long_text(80)})
    assert payload["error"]["code"] == "context_length_exceeded"
    code, _, payload = post(cluster.url + "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert code == 400 and payload["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client(cluster).completions.create(model=MODEL, prompt="hi", top_p=3)
    cluster.wait_idle()
    # Still serving, with the same answers.
    assert client(cluster).completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(request=requests(MODEL))
def test_fuzzed_requests_get_no_5xx_on_a_real_cluster(cluster, request):
    cluster.ensure(**DISAGG, transport="shm")  # the deployment of the test above: no redeploy
    path, body = request
    post_and_check(cluster.url + path, body, timeout_s=120)


def test_after_the_fuzzing_no_block_is_held_and_answers_are_unchanged(cluster, expected):
    cluster.ensure(**DISAGG, transport="shm")
    cluster.wait_idle()  # nothing running, waiting or reserved, no block held, on every replica
    assert complete(client(cluster), PROMPTS[0], stream=True) == expected(PROMPTS[0])


@pytest.mark.chaos
def test_client_disconnect_mid_stream_frees_blocks_on_both_pools(cluster):
    cluster.ensure(**DISAGG, transport="shm")
    connection = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=120)
    body = {"model": MODEL, "prompt": long_text(2), "max_tokens": 300, "stream": True, "ignore_eos": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    events = 0
    while events < 3:
        line = response.readline()
        events += line.startswith(b"data: {")
    connection.sock.shutdown(2)  # the client goes away mid-stream
    connection.close()
    status = cluster.wait_idle(timeout_s=60)
    assert status["metrics"]["outcomes"].get("cancelled", 0) >= 1


async def post_raw(port: int, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A POST /v1/completions on a socket of the test's own (to cut it, or read the raw stream)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    return reader, writer


@pytest.mark.chaos
def test_a_hundred_streaming_clients_gone_at_once_leak_nothing(cluster, expected):
    """100 streams opened together (far more than the decode pool's KV holds: most wait for blocks
    in its FIFO, some are prefilling, a few decode), every client gone at once as soon as ten have
    a token. Every request ends, both pools drain to zero blocks, the next request is exact."""
    cluster.ensure(**DISAGG, transport="shm")
    cancelled_before = cluster.status()["metrics"]["outcomes"].get("cancelled", 0)  # the deployment is shared
    body = {"max_tokens": 200, "stream": True, "ignore_eos": True, "model": MODEL}

    async def open_stream(i: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await post_raw(cluster.port, {**body, "prompt": f"{PROMPTS[i % len(PROMPTS)]} (client {i})"})

    async def first_token(reader: asyncio.StreamReader) -> bool:
        while line := await reader.readline():
            if line.startswith(b"data: {"):
                return True
        return False  # the response ended without a token (an error status)

    async def drill() -> int:
        streams = await asyncio.gather(*(open_stream(i) for i in range(100)))
        pending = {asyncio.ensure_future(first_token(reader)) for reader, _ in streams}
        with_token, deadline = 0, time.monotonic() + 120
        while pending and with_token < 10 and time.monotonic() < deadline:
            done, pending = await asyncio.wait(pending, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            with_token += sum(task.result() for task in done)
        for _, writer in streams:  # every client at once
            writer.transport.abort()
        for task in pending:
            task.cancel()
        return with_token

    assert asyncio.run(drill()) >= 10
    status = cluster.wait_idle(timeout_s=120)
    outcomes = status["metrics"]["outcomes"]
    assert outcomes.get("cancelled", 0) - cancelled_before >= 80, outcomes  # the rest finished or were refused
    assert complete(client(cluster), PROMPTS[0], stream=True) == expected(PROMPTS[0])


@pytest.mark.chaos
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_prefill_tp_shard_killed_mid_prefill_fails_over_to_decode_until_serve_replaces_the_replica(
    cluster, expected, how
):
    """The only prefill replica (TP=3) loses a shard process mid-prefill: its engine stops. The
    requests it held are retried on their decode replica, and so is every request while the
    replica is failed or being replaced: all answer exactly. Serve's health check replaces the
    replica (new shard processes) within the bound below; then nothing is held anywhere. A shard
    stopped (SIGSTOP: alive, silent, its sockets open) is found by its heartbeat going quiet
    (shard_heartbeat_timeout_s, 10 s) and the replica fails as for a dead one."""
    cluster.ensure(**DISAGG, transport="shm")
    deadline = time.monotonic() + 60
    while True:  # a replica just deployed reports its shards' processes within a second or so
        (replica,) = cluster.status()["pools"]["prefill"]
        old_shards = replica["shard_pids"]
        if len(old_shards) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(old_shards) == 2 and all(pid > 0 for pid in old_shards), replica
    retries_before = cluster.status()["retries"]
    with long_prompts_in_flight(cluster, expected, 4, f"Shard drill {how.name}"):  # prefill busy for a second or more
        os.kill(old_shards[-1], how)
        killed = time.monotonic()
        # A request right after the kill answers exactly too. (Had the prompts been computed
        # before the kill, it is the step that finds the shard gone.)
        assert complete(client(cluster), PROMPTS[0], stream=True) == expected(PROMPTS[0])
    assert cluster.status()["retries"] > retries_before  # requests failed over to decode
    recovery_bound_s = 180.0
    while True:
        prefill = cluster.status()["pools"].get("prefill", [])
        replaced = all(r["shard_pids"] and not set(r["shard_pids"]) & set(old_shards) for r in prefill)
        if prefill and replaced and all(not r["engine_error"] for r in prefill):
            break
        assert time.monotonic() - killed < recovery_bound_s, prefill
        assert get_json(cluster.url + "/health")["status"] in ("ok", "degraded")  # never 503: it serves
        time.sleep(1.0)
    cluster.wait_healthy()
    cluster.wait_idle(timeout_s=60)
    assert complete(client(cluster), PROMPTS[1], stream=False) == expected(PROMPTS[1])  # the new replica


@pytest.mark.chaos
def test_the_router_killed_mid_stream_cuts_its_clients_and_the_pools_drop_their_requests(cluster, expected):
    """SIGKILL to the router replica while six streams decode: each client's stream ends at once
    without [DONE] (a cut, not a finished answer); Serve restarts the router on the same port within
    the bound below; the pools abort the orphaned requests (2,000 tokens each would decode for
    minutes) and hold nothing; the next request is exact."""
    cluster.ensure(**DISAGG, transport="shm")
    cluster.wait_healthy()
    cluster.wait_idle(timeout_s=180)  # a whole cluster to start from, whatever the drill before left
    router_pid = cluster.status()["router_pid"]
    assert router_pid > 0  # never os.kill(0, ...): that is this whole process group
    body = {"model": MODEL, "max_tokens": 2000, "stream": True, "ignore_eos": True}

    async def stream(i: int, started: asyncio.Event, counts: list[int]) -> bytes:
        reader, writer = await post_raw(cluster.port, {**body, "prompt": f"{PROMPTS[i % len(PROMPTS)]} (stream {i})"})
        last = b""
        try:
            while line := await reader.readline():
                if line.startswith(b"data: {"):
                    counts[i] += 1
                    if all(counts):
                        started.set()
                last = line.strip() or last
        except ConnectionError:
            pass
        finally:
            writer.close()
        return last

    async def drill() -> tuple[list[bytes], list[int], float]:
        started, counts = asyncio.Event(), [0] * 6
        clients = [asyncio.ensure_future(stream(i, started, counts)) for i in range(6)]
        await asyncio.wait_for(started.wait(), 120)  # every stream has a token
        os.kill(router_pid, signal.SIGKILL)
        killed = time.monotonic()
        lasts = await asyncio.wait_for(asyncio.gather(*clients), 30)
        return lasts, counts, time.monotonic() - killed

    lasts, counts, cut_after_s = asyncio.run(drill())
    assert all(0 < n < 2000 for n in counts), counts
    assert all(last != b"data: [DONE]" for last in lasts), lasts
    killed = time.monotonic() - cut_after_s
    restart_bound_s = 120.0
    while True:
        try:
            if cluster.status()["router_pid"] not in (0, router_pid):
                break
        except OSError:  # refused or reset: the new router is not listening yet
            pass
        assert time.monotonic() - killed < restart_bound_s, "Serve did not restart the router in time"
        time.sleep(0.5)
    cluster.wait_healthy()  # the new router has asked both pools (its view of them starts empty)
    cluster.wait_idle(timeout_s=30)  # well before 2,000 tokens could have decoded: the pools aborted them
    assert complete(client(cluster), PROMPTS[0], stream=True) == expected(PROMPTS[0])


# --- colocated: one deployment of 2 replicas for every colocated test ---------------------------
# Room for a 1,000-token stream beside the prompts (32 MiB of float32 KV holds ~700 tokens); a
# stream interval of 4 changes chunking only, which the greedy checks compare as whole texts.
# Tool calls under "auto" read as Llama 3's JSON: the one format the default model writes unasked.
COLOCATED = {
    "mode": "colocated",
    "kv_cache_memory": 96 * 2**20,
    "colocated.replicas": 2,
    "stream_interval": 4,
    "tool_call_parser": "llama3_json",
}


def test_colocated_greedy_matches_transformers(cluster, expected):
    cluster.ensure(**COLOCATED)
    check_greedy(cluster, expected)
    # The engine's queue and prefill times reach the router with each request's last delta.
    samples = scrape(cluster)
    assert samples[("pdserve:request_prefill_time_seconds_count", MODEL_LABEL)] == 8
    assert samples[("pdserve:request_queue_time_seconds_count", MODEL_LABEL)] == 8
    assert samples[("pdserve:time_to_first_token_seconds_count", MODEL_LABEL)] == 8
    assert by_pool(samples, "pdserve:num_requests_running")["colocated"] == 0


def test_colocated_choices_and_prompt_logprobs_as_a_vllm_client_asks_them(cluster, tokenizer, hf_smol, expected):
    cluster.ensure(**COLOCATED)  # two replicas: a prompt's later choices find the one holding its blocks
    check_choices_and_prompt_logprobs(cluster, tokenizer, hf_smol, expected, "colocated")


def test_colocated_structured_outputs_and_tool_calls(cluster):
    cluster.ensure(**COLOCATED)
    check_structured_outputs_and_tools(cluster, "llama3_json")


def test_cache_aware_placement_sends_a_shared_prefix_to_the_replica_holding_it_though_it_is_busier(cluster, tokenizer):
    cluster.ensure(**COLOCATED)
    # Warm: both replicas have measured their prefill rate (how fast routed prompts drain) and said
    # so. Two prompts at once usually land one on each; when both land on one, warm again.
    for round_ in range(5):
        bodies = [{"model": MODEL, "prompt": f"Warm {round_}.{i}: " + long_text(1), "max_tokens": 2} for i in range(2)]
        warm = [threading.Thread(target=post, args=(cluster.url + "/v1/completions", body)) for body in bodies]
        for thread in warm:
            thread.start()
        for thread in warm:
            thread.join()
        deadline = time.monotonic() + 5  # reports come once a second
        while not (warmed := all(r["prefill_tokens_per_s"] > 0 for r in cluster.status()["pools"]["colocated"])):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if warmed:
            break
    assert warmed, cluster.status()["pools"]
    shared = "Placement: " + long_text(3)
    num_shared_blocks = len(tokenizer.encode(shared)) // cluster.config.block_size
    # A long stream keeps one replica busy; its prompt's blocks are in that replica's prefix cache.
    connection = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=120)
    body = {"model": MODEL, "prompt": shared + " First,", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    busy = connection.getresponse()
    assert busy.status == 200 and busy.readline().startswith(b"data: {")  # its prompt is computed
    # Past the router's memory of what it routed: only the replicas' reports of their caches can
    # tell where the prefix is now.
    time.sleep(ROUTED_MEMORY_S + 1.5)
    try:
        # The same prefix again: least-loaded would pick the idle replica and compute it all; the
        # cache-aware policy picks the busy one, whose cache saves all but the last partial block.
        status, _, payload = post(
            cluster.url + "/v1/completions", {"model": MODEL, "prompt": shared + " Second,", "max_tokens": 2}
        )
        assert status == 200, payload
        cached = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (num_shared_blocks - 1) * cluster.config.block_size, cached
    finally:
        connection.close()
    cluster.wait_idle()


def test_stream_interval_sends_the_first_token_alone_then_n_at_a_time_with_the_same_text(cluster, expected):
    cluster.ensure(**COLOCATED)
    api = client(cluster)
    assert complete(api, PROMPTS[1], stream=True) == expected(PROMPTS[1])
    chunks = api.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        logprobs=0,  # one entry per token: how many tokens each chunk carried
        extra_body={"ignore_eos": True},
    )
    sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs]
    assert sizes == [1, 4, 4, 3], sizes  # 12 tokens; with interval 1 it would be twelve 1s
    cluster.wait_idle()


# --- conditional disaggregation ---------------------------------------------------------------
# A 10 ms stall bound: beside a running batch a prompt goes in chunks of 32 tokens (the floor),
# each costing the batch's step on top, so a long one is far sooner on an idle prefill pool.
CONDITIONAL = {
    "mode": "disagg",
    "transport": "shm",
    "router.conditional_disaggregation": True,
    "router.local_prefill_max_stall_s": 0.01,
    "kv_cache_memory": 96 * 2**20,  # the long prompt beside the running stream
    "tracing": f"file:{TRACE_FILE}",
}


def prompts_by_site(cluster: LocalCluster) -> dict[str, float]:
    samples = scrape(cluster)
    return {
        site: samples.get(("pdserve:prefill_site_total", (("model_name", MODEL), ("site", site))), 0.0)
        for site in ("local", "remote")
    }


def test_conditional_disaggregation_prefills_on_an_idle_decode_replica_and_keeps_long_prompts_off_a_busy_one(
    cluster, expected
):
    cluster.ensure(**CONDITIONAL)
    # Until the prefill pool has measured its rate the router has no estimate: the pool computes.
    warm = "Warm: " + long_text(1)
    assert complete(client(cluster), warm, stream=False, max_tokens=2) == expected(warm, 2)
    assert prompts_by_site(cluster) == {"local": 0, "remote": 1}
    deadline = time.monotonic() + 30
    while not all(r["prefill_tokens_per_s"] > 0 for r in cluster.status()["pools"]["prefill"]):
        assert time.monotonic() < deadline, cluster.status()["pools"]
        time.sleep(0.2)
    # Idle: computing the prompt where it will be decoded saves the whole hand-off; the tokens are
    # transformers' greedy ones all the same.
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    status, _, payload = post(
        cluster.url + "/v1/completions",
        {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0},
        headers,
    )
    assert status == 200 and payload["choices"][0]["text"] == expected(PROMPTS[0])
    for prompt in PROMPTS[1:3]:
        assert complete(client(cluster), prompt, stream=True) == expected(prompt)
    assert prompts_by_site(cluster) == {"local": 3, "remote": 1}
    # Busy: a long prompt (1,354 tokens: 43 chunks, each with a decode step of the running stream)
    # is sooner on the idle prefill pool, which computes it while the stream goes on.
    connection = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=120)
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    busy = connection.getresponse()
    try:
        assert busy.status == 200 and busy.readline().startswith(b"data: {")
        long_prompt = "Long: " + long_text(16)
        assert complete(client(cluster), long_prompt, stream=False, max_tokens=4) == expected(long_prompt, 4)
    finally:
        connection.close()
    assert prompts_by_site(cluster) == {"local": 4, "remote": 2}
    cluster.wait_idle()
    # The decision and its reason are on the request's trace, with the prompt's steps on decode.
    deadline = time.monotonic() + 30
    while True:
        lines = TRACE_FILE.read_text().splitlines() if TRACE_FILE.exists() else []
        spans = [s for s in map(json.loads, lines) if s["context"]["trace_id"] == f"0x{trace_id}"]
        names = {s["name"] for s in spans}
        if {"pdserve.decode", "pdserve.prefill.chunk"} <= names or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    (decode,) = [s for s in spans if s["name"] == "pdserve.decode"]
    assert decode["attributes"]["pdserve.prefill_site"] == "local"
    assert decode["attributes"]["pdserve.prefill_site.reason"].startswith("local: ")
    assert "pdserve.prefill" not in names and "pdserve.decode.kv_wait" not in names


# --- operations: overload, scaling, a decode replica killed -----------------------------------
OPS = {
    "mode": "disagg",
    "transport": "shm",
    "decode.replicas": 2,
    "router.max_concurrent_requests": 3,
}


@pytest.mark.chaos
def test_overload_is_refused_with_503_and_retry_after(cluster):
    cluster.ensure(**OPS)
    # Long enough to be in flight when the fourth request comes (it is sent once three are).
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 96, "ignore_eos": True}
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(post(cluster.url + "/v1/completions", body))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while cluster.status()["in_flight"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    code, headers, payload = post(cluster.url + "/v1/completions", {**body, "max_tokens": 1})
    for t in threads:
        t.join()
    assert code == 503 and headers.get("retry-after") == "1", payload
    assert payload["error"]["type"] == "service_unavailable"
    assert [r[0] for r in results] == [200, 200, 200]
    cluster.wait_idle()


def _end_stopped(pid: int | None, how: signal.Signals) -> None:
    """Once a drill has seen its clients served, a replica it stopped (SIGSTOP) is killed, as a
    liveness probe or an operator would end it: Serve, replacing it, asks the frozen actor to shut
    down gracefully and waits graceful_shutdown_timeout_s (the request timeout, 600 s) for an
    answer that never comes, holding every later redeploy and resize (the drills after these took
    ~7 minutes each)."""
    if how == signal.SIGSTOP and pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.chaos
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_decode_replica_killed_mid_stream_resumes_with_the_same_tokens(cluster, expected, how):
    """Killed, the stream's call fails and resumes on the other replica; stopped (SIGSTOP: alive and
    silent, which Serve's health checks take ~100 s to replace), the router's inter-token watchdog
    (router.inter_token_timeout_s, 5 s here) moves it there."""
    cluster.ensure(**OPS, **({"router.inter_token_timeout_s": 5.0} if how == signal.SIGSTOP else {}))
    prompt, max_tokens = PROMPTS[2], 96
    chunks = client(cluster).completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    text, killed = [], None
    try:
        for chunk in chunks:
            text.extend(c.text for c in chunk.choices)
            if killed is None and len(text) >= 3:
                status = cluster.status()
                (serving,) = [r["decode_replica"] for r in status["requests"]]
                (killed,) = [r["pid"] for r in status["pools"]["decode"] if r["replica_id"] == serving]
                assert killed > 0  # never os.kill(0, ...): that is this whole process group
                os.kill(killed, how)
                stopped_at = time.monotonic()
        assert killed is not None
        assert "".join(text) == expected(prompt, max_tokens)
        if how == signal.SIGSTOP:
            assert time.monotonic() - stopped_at < 60  # the watchdog's 5 s and the rest of the stream
        status = cluster.status()
        assert status["resumes"] == 1
    finally:
        _end_stopped(killed, how)
    cluster.wait_idle(timeout_s=180)  # Serve replaces the dead replica; the survivors hold nothing


@pytest.mark.chaos
def test_scaling_each_pool_under_steady_load_fails_no_request(cluster, expected):
    cluster.ensure(**{**OPS, "router.max_concurrent_requests": 64})
    stop = threading.Event()
    outcomes: list[tuple[int, str]] = []

    def steady_load() -> None:
        i = 0
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            code, _, payload = post(
                cluster.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
            )
            outcomes.append((code, payload["choices"][0]["text"] if code == 200 else json.dumps(payload)))
            i += 1

    workers = [threading.Thread(target=steady_load) for _ in range(2)]
    for w in workers:
        w.start()
    router_pid = cluster.status()["router_pid"]
    try:
        # Each pool grows and shrinks; the last size is the next test's deployment (no redeploy).
        for prefill, decode in [(2, 1), (1, 2), (2, 2)]:
            # POST /pdserve/scale, as `pdserve scale` sends it (no key is configured on loopback).
            assert cluster.scale(prefill=prefill, decode=decode) == {"prefill": prefill, "decode": decode}
            time.sleep(2)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert len(outcomes) > 8
    failures = [o for o in outcomes if o[0] != 200]
    assert not failures, failures[:3]
    assert {text for _, text in outcomes} <= {expected(p, 6) for p in PROMPTS}
    assert cluster.status()["router_pid"] == router_pid  # resized in place: the router was never replaced
    cluster.wait_idle()


@pytest.mark.chaos
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_prefill_replica_killed_mid_prefill_is_retried_elsewhere(cluster, expected, tokenizer, how):
    """Killed, the prefill call fails and the prompt is retried; stopped (SIGSTOP: alive and
    silent), its prompts' KV never comes, the decode side's lease runs out (30 s here) and the
    prompt is computed on decode, never sent to that replica again: every answer exact."""
    cluster.ensure(**{**OPS, "router.max_concurrent_requests": 64, "prefill.replicas": 2})
    status = cluster.status()
    deadline = time.monotonic() + 60
    while len([r for r in status["pools"].get("prefill", []) if r["pid"] > 0]) < 2:  # both replicas reported
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
        status = cluster.status()
    victim = max(status["pools"]["prefill"], key=lambda r: r["replica_id"])
    assert victim["pid"] > 0  # never os.kill(0, ...): that is this whole process group
    try:
        with long_prompts_in_flight(
            cluster, expected, 6, f"Replica drill {how.name}"
        ):  # the prefill pool is busy for seconds with these
            os.kill(victim["pid"], how)
            hit = time.monotonic()
        assert time.monotonic() - hit < 2 * 30.0  # every prompt answered within twice the KV lease
        assert cluster.status()["retries"] >= 1
    finally:
        _end_stopped(victim["pid"], how)
    cluster.wait_idle(timeout_s=180)


# Every queue on a request's way made tiny: the router's admission, the decode replica's FIFO of
# reservations waiting for KV blocks, Serve's queue in front of the prefill replica and the prefill
# engine's waiting queue. The decode replica has three shards (for the shard drill after the burst;
# SmolLM2's 3 KV heads take TP 1 or 3).
QUEUES = {
    "mode": "disagg",
    "transport": "shm",
    "decode.tensor_parallel_size": 3,
    "router.max_concurrent_requests": 40,
    "decode.max_num_waiting": 4,
    "prefill.max_ongoing_requests": 2,
    "prefill.max_num_waiting": 1,
}
# Which queue turned a request away, by its 503's message.
REFUSALS = {
    "router admission": "max_concurrent_requests",
    "decode KV FIFO": "waiting for KV blocks",
    "prefill Serve queue": "every replica's queue is full",
    "prefill waiting queue": "max_num_waiting",
}


@pytest.mark.chaos
def test_a_burst_past_every_queue_is_answered_exactly_or_refused_with_503_and_leaks_nothing(cluster, expected):
    cluster.ensure(**QUEUES)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (queue drill {i})" for i in range(64)]
    api = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(prompt: str) -> tuple[int, str, str | None]:
        try:
            response = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        except openai.APIStatusError as exc:
            return exc.status_code, json.dumps(exc.body), exc.response.headers.get("retry-after")
        return 200, response.choices[0].text, None

    async def burst() -> list[tuple[int, str, str | None]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    outcomes = asyncio.run(burst())
    refused = [(body, retry_after) for code, body, retry_after in outcomes if code == 503]
    assert {code for code, _, _ in outcomes} <= {200, 503}, [o for o in outcomes if o[0] not in (200, 503)]
    answered = {p: text for p, (code, text, _) in zip(prompts, outcomes, strict=True) if code == 200}
    assert answered and answered == {p: expected(p, 8) for p in answered}
    assert all(retry_after is not None and '"type": "service_unavailable"' in body for body, retry_after in refused)
    queues = {name for name, words in REFUSALS.items() for body, _ in refused if words in body}
    print(f"{len(outcomes) - len(refused)} answered, {len(refused)} refused by {sorted(queues)}")
    assert len(queues) >= 2, refused[:4]  # the burst overflowed more than the router's own admission
    cluster.wait_idle(timeout_s=120)
    assert complete(client(cluster), PROMPTS[0], stream=True) == expected(PROMPTS[0])


@pytest.mark.chaos
def test_a_decode_tp_shard_killed_mid_stream_resumes_every_stream_once_serve_replaced_the_replica(cluster, expected):
    """The only decode replica (TP=3) loses a shard process while three streams decode: its engine
    stops. Each stream resumes (prompt + tokens sent) once Serve has replaced the replica, within
    its deadline, and continues token for token; a new request meanwhile is served or gets the
    documented 503. The replacement comes within the bound below; then nothing is held anywhere."""
    cluster.ensure(**QUEUES)
    (replica,) = cluster.status()["pools"]["decode"]
    old_shards = replica["shard_pids"]
    assert len(old_shards) == 2 and all(pid > 0 for pid in old_shards), replica
    resumes_before = cluster.status()["resumes"]
    api = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    prompts, max_tokens = PROMPTS[:3], 32

    async def one(prompt: str, counts: dict[str, int], started: asyncio.Event) -> str:
        chunks = await api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        text = []
        async for chunk in chunks:
            text.extend(c.text for c in chunk.choices)
            counts[prompt] += 1
            if len(counts) == len(prompts) and min(counts.values()) >= 3:
                started.set()
        return "".join(text)

    async def drill() -> tuple[list[str], set[int]]:
        counts: dict[str, int] = {p: 0 for p in prompts}
        started = asyncio.Event()
        streams = asyncio.gather(*(one(p, counts, started) for p in prompts))
        await asyncio.wait_for(started.wait(), 120)
        os.kill(old_shards[-1], signal.SIGKILL)
        await asyncio.sleep(1.0)
        code, _, _ = await asyncio.to_thread(
            post, cluster.url + "/v1/completions", {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 4}
        )
        return await streams, {code}

    texts, meanwhile = asyncio.run(drill())
    assert texts == [expected(p, max_tokens) for p in prompts]
    assert meanwhile <= {200, 503}, meanwhile
    assert cluster.status()["resumes"] - resumes_before >= 1
    recovery_bound_s, started = 180.0, time.monotonic()
    while True:
        decode = cluster.status()["pools"].get("decode", [])
        replaced = all(r["shard_pids"] and not set(r["shard_pids"]) & set(old_shards) for r in decode)
        if decode and replaced and all(not r["engine_error"] for r in decode):
            break
        assert time.monotonic() - started < recovery_bound_s, decode
        time.sleep(1.0)
    cluster.wait_healthy()
    cluster.wait_idle(timeout_s=60)
    assert complete(client(cluster), PROMPTS[0], stream=True) == expected(PROMPTS[0])


# --- structured outputs and tool calls ----------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "pt"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 32}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 16}},
            "required": ["zone"],
        },
    },
}


GRAMMAR_COUNTERS = (
    *("pdserve:grammar_compiles_total", "pdserve:grammar_cache_hits_total"),
    *("pdserve:constrained_tokens_total", "pdserve:grammar_compile_seconds_total"),
)


def streamed_tool_calls(stream) -> tuple[str, list[dict], str | None]:
    """A streamed chat answer's content, its tool calls reassembled from their deltas, and its finish."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _all_at_once(*checks: Callable[[], None]) -> None:
    """Independent requests sent together (the replicas batch them); a failed check fails the test."""
    with concurrent.futures.ThreadPoolExecutor(len(checks)) as pool:
        for done in [pool.submit(check) for check in checks]:
            done.result()


def check_structured_outputs_and_tools(cluster: LocalCluster, parser: str) -> None:
    """A json_schema answer validates, greedy and sampled, streamed and not; json_object, a regex, a
    choice and a grammar hold; tool_choice required and named always give a call that validates,
    streamed as the same call; auto reads what the model writes; a full round trip (call, tool
    message, answer) goes through the openai client; bad constraints are 400s that name their
    field; nothing is left held; the replicas count compiles, cache hits and masked tokens."""
    import jsonschema

    api = client(cluster)
    ask = [{"role": "user", "content": "Describe a person as JSON: name, age, languages."}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    greedy: dict[bool, str] = {}

    def person(temperature: float, seed: int | None, stream: bool) -> Callable[[], None]:
        def check() -> None:
            params = dict(model=MODEL, messages=ask, response_format=schema_format, max_tokens=120)
            params.update(temperature=temperature, seed=seed)
            if stream:
                chunks = api.chat.completions.create(**params, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                answer = api.chat.completions.create(**params).choices[0]
                assert answer.finish_reason == "stop"
                text = answer.message.content
            jsonschema.validate(json.loads(text), PERSON)
            if temperature == 0.0:
                greedy[stream] = text

        return check

    def json_object() -> None:
        paris = [{"role": "user", "content": "Give a JSON object with the keys city and country for Paris."}]
        answer = api.chat.completions.create(
            model=MODEL, messages=paris, response_format={"type": "json_object"}, max_tokens=60, temperature=0
        ).choices[0]
        assert answer.finish_reason == "stop" and isinstance(json.loads(answer.message.content), dict)

    def regex() -> None:
        pattern = r"\(\d{3}\) \d{3}-\d{4}"
        phone = api.completions.create(
            model=MODEL,
            prompt="My phone number is",
            max_tokens=20,
            temperature=0.8,
            seed=3,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        assert re.fullmatch(pattern, phone.choices[0].text)

    def choice() -> None:
        mood = api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Happy or sad?"}],
            max_tokens=5,
            extra_body={"guided_choice": ["happy", "sad", "neither"]},
        )
        assert mood.choices[0].message.content in ("happy", "sad", "neither")

    def grammar() -> None:
        counted = api.completions.create(
            model=MODEL,
            prompt="Count:",
            max_tokens=30,
            extra_body={"structured_outputs": {"grammar": 'root ::= "one, " item ", " item\nitem ::= "two" | "three"'}},
        )
        assert re.fullmatch(r"one, (two|three), (two|three)", counted.choices[0].text)

    _all_at_once(
        *(person(t, seed, stream) for t, seed in ((0.0, None), (1.0, 5), (1.0, 6)) for stream in (False, True)),
        json_object,
        regex,
        choice,
        grammar,
    )
    assert greedy[True] == greedy[False]

    weather_args = WEATHER["function"]["parameters"]
    question = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}

    def forced(tool_choice: str | dict, stream: bool) -> Callable[[], None]:
        def check() -> None:
            # One call at most: a sampled list of calls may run past max_tokens (then it is content).
            params = dict(model=MODEL, messages=question, tools=[WEATHER, TIME], tool_choice=tool_choice)
            params.update(parallel_tool_calls=False, max_tokens=80)
            if stream:
                content, calls, finish = streamed_tool_calls(api.chat.completions.create(**params, stream=True))
            else:
                message = api.chat.completions.create(**params).choices[0]
                finish, content = message.finish_reason, message.message.content
                assert message.message.tool_calls, message
                calls = [
                    {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                    for c in message.message.tool_calls
                ]
            assert not content and calls and all(call["id"] for call in calls)
            assert finish == ("tool_calls" if tool_choice == "required" else "stop")
            for call in calls:
                assert call["name"] in ("get_weather", "get_time")
                if call["name"] == "get_weather":
                    jsonschema.validate(json.loads(call["arguments"]), weather_args)
            if tool_choice != "required":
                assert [call["name"] for call in calls] == ["get_weather"]

        return check

    def auto() -> None:
        # hermes (the default model's template shows no tools, so the router shows them the Hermes
        # way): this question is answered in text; read as Llama 3's JSON, the model starts an
        # object, and the structural tag makes it a call with arguments that validate.
        params = dict(model=MODEL, tools=[WEATHER], max_tokens=60, temperature=0)
        if parser == "hermes":
            message = api.chat.completions.create(messages=question, **params).choices[0]
            assert message.finish_reason in ("stop", "length") and message.message.content
            assert not message.message.tool_calls
            return
        asked = [
            {"role": "system", "content": "Reply in JSON only."},  # its first token: "{" by 0.5 nats over "```"
            {"role": "user", "content": "Give a JSON object with the keys city and country for Paris."},
        ]
        message = api.chat.completions.create(messages=asked, **params).choices[0]
        assert message.finish_reason == "tool_calls" and not message.message.content, message
        (call,) = message.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), weather_args)
        _, streamed, finish = streamed_tool_calls(api.chat.completions.create(messages=asked, **params, stream=True))
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
            ("get_weather", json.loads(call.function.arguments))
        ]

    calls_greedy: dict[bool, Any] = {}

    def named_greedy(stream: bool) -> Callable[[], None]:
        def check() -> None:
            params = dict(model=MODEL, messages=question, tools=[WEATHER], tool_choice=named, max_tokens=80)
            if stream:
                _, calls, _ = streamed_tool_calls(api.chat.completions.create(**params, temperature=0, stream=True))
                calls_greedy[True] = [(c["name"], c["arguments"]) for c in calls]
            else:
                calls_greedy[False] = api.chat.completions.create(**params, temperature=0).choices[0].message

        return check

    _all_at_once(
        *(forced(tool_choice, stream) for tool_choice in ("required", named) for stream in (False, True)),
        auto,
        named_greedy(False),
        named_greedy(True),
    )
    first = calls_greedy[False]
    call = first.tool_calls[0]
    assert calls_greedy[True] == [(call.function.name, call.function.arguments)]
    history = [*question, first, {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    final = api.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=30, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.choices[0].message.content or final.choices[0].message.tool_calls

    bad = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex"),
        ({"extra_body": {"guided_grammar": "root ::= missing"}}, "guided_grammar"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(40)}}},
            "response_format.json_schema.schema",
        ),
    ]
    for fields, param in bad:
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model=MODEL, messages=question, max_tokens=8, **fields)
        assert refused.value.body["param"] == param, refused.value.body
    cluster.wait_idle()

    # Compiles, cache hits and masked tokens reach /metrics from the replicas' reports (each
    # second): the person schema went out six times, so its later requests hit the cache.
    deadline = time.monotonic() + 15
    while True:
        samples = scrape(cluster)
        figures = {name: sum(by_pool(samples, name).values()) for name in GRAMMAR_COUNTERS}
        if all(figures.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(figures.values()), figures
    assert figures["pdserve:constrained_tokens_total"] >= 100


def _nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_random_weight_model_s_answers_hold_to_their_schema_served_disaggregated(cluster, tiny_dir):
    """Constraints must hold whatever the weights: a random-weight model of the real shape, served
    disaggregated (its prefill replica samples the first token under the constraint), greedy and
    sampled, streamed and not, through the openai client."""
    import jsonschema

    cluster.ensure(model=str(tiny_dir), served_model_name=MODEL)
    api = client(cluster)
    ask = [{"role": "user", "content": "A person, please."}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for temperature, seed in ((0.0, None), (1.3, 1), (1.3, 2)):
        common = dict(model=MODEL, messages=ask, max_tokens=200, temperature=temperature, seed=seed)
        answer = api.chat.completions.create(response_format=schema_format, **common).choices[0]
        assert answer.finish_reason == "stop", answer
        jsonschema.validate(json.loads(answer.message.content), PERSON)
        streamed = api.chat.completions.create(response_format=schema_format, stream=True, **common)
        jsonschema.validate(
            json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)), PERSON
        )
        date = api.chat.completions.create(extra_body={"guided_regex": r"20\d\d-[01]\d-[0-3]\d"}, **common)
        assert re.fullmatch(r"20\d\d-[01]\d-[0-3]\d", date.choices[0].message.content)
        call = api.chat.completions.create(tools=[WEATHER], tool_choice="required", **common).choices[0]
        assert call.finish_reason == "tool_calls" and call.message.tool_calls
        for tool_call in call.message.tool_calls:
            assert tool_call.function.name == "get_weather"
            jsonschema.validate(json.loads(tool_call.function.arguments), WEATHER["function"]["parameters"])
    cluster.wait_idle()
