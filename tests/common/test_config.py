from __future__ import annotations

import pytest

from common.config import CacheConfig, EngineConfig, EngineRole, ModelConfig, ParallelConfig, SchedulerConfig
from common.errors import ConfigError


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: ModelConfig(dtype="float64"), "dtype='float64'"),
        (lambda: ModelConfig(device="tpu"), "device='tpu'"),
        (lambda: ModelConfig(compile="no"), "compile='no' must be true or false"),
        (lambda: CacheConfig(block_size=12), "block_size=12 must be a power of two"),
        (lambda: CacheConfig(kv_cache_memory=1.5), "kv_cache_memory=1.5"),
        (lambda: CacheConfig(kv_cache_memory=0), "kv_cache_memory=0"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs=0"),
        (lambda: SchedulerConfig(role="router"), "router"),
        (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size=0"),
    ],
)
def test_bad_values_name_the_key(factory, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        factory()


def test_round_trip_through_plain_dict():
    config = EngineConfig(
        model=ModelConfig(dtype="bfloat16"),
        cache=CacheConfig(block_size=32, kv_cache_memory=1 << 28),
        scheduler=SchedulerConfig(role=EngineRole.DECODE, max_prefill_chunk=256),
        parallel=ParallelConfig(tensor_parallel_size=3),
    )
    data = config.to_dict()
    assert data["scheduler"]["role"] == "decode"
    assert EngineConfig.from_dict(data) == config
    assert SchedulerConfig(max_num_batched_tokens=100, max_prefill_chunk=500).prefill_chunk == 100
