"""An instance given cores (a serving replica's claim) pins each shard's process to its own slice."""

from __future__ import annotations

import os

import pytest
import torch

from common.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from common.cpu_cores import host_cores, pin_process
from common.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine


@pytest.mark.skipif(len(host_cores()) < 2, reason="needs two cores")
def test_each_shard_runs_on_its_slice_of_the_instances_cores(tiny_dir):
    before, threads = host_cores(), torch.get_num_threads()
    cores = before[-2:]
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_dir)),
        cache=CacheConfig(kv_cache_memory=8 * 2**20),
        parallel=ParallelConfig(tensor_parallel_size=2, cpu_cores=cores),
    )
    engine = LLMEngine(config)
    try:
        (shard,) = engine.executor.workers
        assert engine.executor.shard_pids == [shard.process.pid]  # what replica reports show operators
        assert os.sched_getaffinity(0) == {cores[0]}  # the driver's whole process, every thread
        assert all(os.sched_getaffinity(int(t)) == {cores[0]} for t in os.listdir("/proc/self/task"))
        assert os.sched_getaffinity(shard.process.pid) == {cores[1]}
        assert torch.get_num_threads() == 1
        engine.add_request("r", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        outputs = []
        while engine.has_unfinished_requests():
            outputs.extend(engine.step())
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
    finally:
        engine.shutdown()
        pin_process(before)  # the test process is everyone's: give it its cores back
        torch.set_num_threads(threads)
