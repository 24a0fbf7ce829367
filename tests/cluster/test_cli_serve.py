"""`pdserve serve | status | scale` as a user runs them: a real process, a real port, SIGTERM at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.cluster.serving import MODEL, free_port, get_json, post


def _ray_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "raylet|gcs_server|ray::"], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def _pdserve(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_a_bad_config_key_is_named_with_the_fix(tmp_path):
    env = {**os.environ, "PDSERVE_STATE_FILE": str(tmp_path / "state.json")}
    result = _pdserve("serve", "--set", "prefil.replicas=2", env=env, timeout=60)
    assert result.returncode == 2
    assert "prefil" in result.stderr and "did you mean 'prefill'" in result.stderr
    result = _pdserve("status", env=env, timeout=60)
    assert result.returncode == 2 and "pdserve serve" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_serve_answers_reports_scales_and_stops_cleanly_on_sigterm(tmp_path):
    before = _ray_pids()
    port = free_port()
    env = {
        **os.environ,
        "PDSERVE_STATE_FILE": str(tmp_path / "state.json"),
        "PDSERVE_CORE_LOCK_DIR": str(tmp_path / "cores"),
    }
    command = [
        sys.executable,
        "-m",
        "cluster.cli",
        "serve",
        "--mode",
        "disagg",
        "--port",
        str(port),
        "--kv-cache-memory",
        str(32 * 2**20),
    ]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _until_ready(process)
        url = f"http://127.0.0.1:{port}"
        assert get_json(url + "/v1/models")["data"][0]["id"] == MODEL
        # ignore_eos: sampled at the default temperature 1, an early EOS would end it short (it did, once).
        request = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        code, _, body = post(url + "/v1/completions", request)
        assert code == 200 and body["usage"]["completion_tokens"] == 4

        status = _pdserve("status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        pools = json.loads(status.stdout)["pools"]
        assert len(pools["prefill"]) == 1 and len(pools["decode"]) == 1
        # The default split: each pool owns its cores, none shared, and its process runs on them only.
        prefill_cores, decode_cores = set(pools["prefill"][0]["cpu_cores"]), set(pools["decode"][0]["cpu_cores"])
        assert prefill_cores and decode_cores and not prefill_cores & decode_cores
        assert prefill_cores | decode_cores <= os.sched_getaffinity(0)
        for report in pools["prefill"] + pools["decode"]:
            assert os.sched_getaffinity(report["pid"]) == set(report["cpu_cores"]) and not report["cpu_cores_shared"]
        table = _pdserve("status", env=env)
        assert table.returncode == 0 and "cores" in table.stdout.splitlines()[1], table.stdout
        assert str(pools["decode"][0]["pid"]) in table.stdout, table.stdout

        scaled = _pdserve("scale", "decode=2", env=env, timeout=600)
        assert scaled.returncode == 0, scaled.stderr[-3000:]
        deadline = time.monotonic() + 120
        while len(get_json(url + "/pdserve/status")["pools"].get("decode", [])) != 2:
            assert time.monotonic() < deadline, "the decode pool did not grow to 2 replicas"
            time.sleep(1)
        code, _, body = post(url + "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4})
        assert code == 200
    finally:
        returncode = _stopped(process)
    assert returncode == 0
    assert not (tmp_path / "state.json").exists()
    deadline = time.monotonic() + 30
    while (stray := _ray_pids() - before) and time.monotonic() < deadline:
        time.sleep(1)
    assert not stray, f"processes left behind: {stray}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_vllm_launch_line_starts_pdserve_behind_its_api_key(tmp_path, smol_dir):
    """`pdserve serve MODEL --served-model-name … -tp … --max-model-len … --api-key … --chat-template …`
    as a vLLM user types it: the OpenAI client with the key is answered, without it refused (401);
    the router renders chats with the given template; the key is in no file the command wrote."""
    import openai

    from engine.tokenizer import load_tokenizer

    port, key = free_port(), "sk-vllm-style-0001"
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    env = {
        **os.environ,
        "PDSERVE_STATE_FILE": str(tmp_path / "state.json"),
        "PDSERVE_CORE_LOCK_DIR": str(tmp_path / "cores"),
    }
    command = [
        sys.executable, "-m", "cluster.cli", "serve", MODEL,
        "--served-model-name", "smol",
        "-tp", "1",
        "--max-model-len", "1024",
        "--api-key", key,
        "--chat-template", str(template),
        "--port", str(port),
        "--mode", "colocated",
        "--dtype", "float32",
        "--kv-cache-memory", str(64 * 2**20),  # room for the whole 1,024-token context
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = _until_ready(process)
        url = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smol"]
        assert client.models.retrieve("smol").model_extra["max_model_len"] == 1024
        messages = [{"role": "user", "content": "Say hi"}]
        answer = client.chat.completions.create(model="smol", messages=messages, max_tokens=4, temperature=0)
        assert answer.choices[0].message.content and answer.usage.completion_tokens <= 4
        # The prompt is the given template's rendering, not SmolLM2's (which adds a system prompt).
        rendered = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
        assert answer.usage.prompt_tokens == len(load_tokenizer(smol_dir).encode(rendered))
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="sk-wrong-key-0001", max_retries=0).models.list()
        code, _, _ = post(url + "/chat/completions", {"model": "smol", "messages": messages, "max_tokens": 2})
        assert code == 401  # no key at all
        assert key not in (tmp_path / "state.json").read_text()
        assert not any(key in line for line in lines)
    finally:
        returncode = _stopped(process)
    assert returncode == 0


def _until_ready(process: subprocess.Popen) -> list[str]:
    """The server's output up to its "ready" line; its logs are read on after (a full pipe would
    stall the server)."""
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "ready in" in line:
            break
    assert process.poll() is None, "".join(lines[-30:])
    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
    return lines


def _stopped(process: subprocess.Popen) -> int:
    """SIGTERM, as an operator stops it; its exit status (killed, and the test failed, past 120 s)."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(120)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
