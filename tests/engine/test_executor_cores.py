"""An instance given cores (a serving replica's claim) pins each shard's process to its own slice;
an instance sharing its host's process gives the host its threads and cores back when it closes."""

from __future__ import annotations

import os

import pytest
import torch

from common.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from common.cpu_cores import host_cores, pin_process, split_cores
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
        engine.shutdown()
        assert set(os.sched_getaffinity(0)) == set(before) and torch.get_num_threads() == threads
    finally:
        engine.shutdown()
        pin_process(before)  # the test process is everyone's: never leave it pinned, even on failure
        torch.set_num_threads(threads)


@pytest.mark.skipif(len(host_cores()) < 2, reason="needs two cores")
def test_an_offline_tp_engine_gives_its_hosts_threads_back(tiny_dir):
    """A TP=2 driver in a script's process runs on its half of the cores while it lives. Before
    it gave them back, a suite ran every test after its first TP=2 engine on one thread (the
    bfloat16 agreement tests went past their timeout on an AVX2 machine that way)."""
    threads = torch.get_num_threads()
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_dir)),
        cache=CacheConfig(kv_cache_memory=8 * 2**20),
        parallel=ParallelConfig(tensor_parallel_size=2),
    )
    engine = LLMEngine(config)
    try:
        assert torch.get_num_threads() == len(split_cores(0, 2, host_cores()))
    finally:
        engine.shutdown()
    assert torch.get_num_threads() == threads


@pytest.mark.skipif(len(host_cores()) < 2, reason="needs two cores")
def test_an_engine_that_fails_to_start_gives_its_hosts_threads_back(tiny_dir):
    from engine.executor import Executor, WorkerLauncher

    class FailingLauncher(WorkerLauncher):
        def launch(self, rank, world_size, init_method, config, model_dir):
            raise OSError("no shard process could be started")

    threads = torch.get_num_threads()
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_dir)),
        cache=CacheConfig(kv_cache_memory=8 * 2**20),
        parallel=ParallelConfig(tensor_parallel_size=2),
    )
    with pytest.raises(OSError, match="no shard process"):
        Executor(config, tiny_dir, FailingLauncher())
    assert torch.get_num_threads() == threads
