"""How large a shard's KV cache is: vLLM's gpu_memory_utilization arithmetic (fake device numbers:
no GPU here) and its refusal on CPU, where kv_cache_memory sizes the cache."""

from __future__ import annotations

import pytest

from common.config import CacheConfig
from common.errors import ConfigError
from engine.kv_cache_memory import DeviceMemory, activation_reserve, gpu_kv_budget

GIB = 2**30


def test_the_kv_budget_is_the_share_of_total_memory_the_rest_leaves():
    # An 80 GiB device, 16 GiB of weights and 1 GiB of CUDA context loaded: 63 GiB free.
    memory = DeviceMemory(total=80 * GIB, free=63 * GIB)
    assert memory.used == 17 * GIB
    # 0.9 x 80 = 72 GiB this shard may hold; 17 in use, 3 kept for activations: 52 for KV.
    assert gpu_kv_budget(0.9, memory, reserved=3 * GIB) == 52 * GIB
    # Another process's memory counts as used: the shard gets less, never more than its share.
    crowded = DeviceMemory(total=80 * GIB, free=43 * GIB)
    assert gpu_kv_budget(0.9, crowded, reserved=3 * GIB) == 32 * GIB
    assert gpu_kv_budget(1.0, memory, reserved=0) == 63 * GIB  # everything free, as vLLM at 1.0


def test_a_utilization_that_leaves_nothing_is_refused_with_the_numbers():
    memory = DeviceMemory(total=80 * GIB, free=63 * GIB)
    with pytest.raises(ConfigError) as error:
        gpu_kv_budget(0.2, memory, reserved=GIB)  # 16 GiB allowed, 17 in use
    message = str(error.value)
    assert "gpu_memory_utilization=0.2" in message and "80.0 GiB total" in message and "17.00 GiB" in message


def test_the_activation_reserve_grows_with_the_token_budget_and_the_vocabulary():
    small = activation_reserve(2048, 64, 576, 576, 192, 1536, 49152, 2)
    assert activation_reserve(4096, 64, 576, 576, 192, 1536, 49152, 2) > small
    assert activation_reserve(2048, 64, 576, 576, 192, 1536, 128256, 2) > small
    # 2048 tokens of SmolLM2's widths in bfloat16, twice over, plus 64 rows of float32 logits twice.
    assert small == 2 * 2048 * (4 * 576 + 576 + 2 * 192 + 3 * 1536) * 2 + 2 * 64 * 49152 * 4


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1, True, "0.9"])
def test_gpu_memory_utilization_must_be_a_fraction(value):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=value)


def test_on_cpu_gpu_memory_utilization_is_refused_naming_the_flag_and_the_cpu_setting(tiny_dir):
    from engine import LLM

    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization\).*--kv-cache-memory"):
        LLM(str(tiny_dir), dtype="float32", device="cpu", gpu_memory_utilization=0.9)


def test_the_offline_llm_applies_a_chat_template_given_inline_or_as_a_file(tiny_dir, tmp_path):
    from engine import LLM, SamplingParams

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "plain.jinja"
    path.write_text(template)
    params = SamplingParams(temperature=0, max_tokens=1)
    for given in (template, str(path)):
        with LLM(str(tiny_dir), dtype="float32", kv_cache_memory=16 * 2**20, chat_template=given) as llm:
            assert llm.tokenizer.chat_template == template
            out = llm.chat([{"role": "user", "content": "hi"}], params)
            assert out[0].prompt_token_ids == llm.tokenizer.encode("[user] hi\n", add_special_tokens=False)
