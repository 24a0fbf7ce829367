"""Runs a step on every shard of a model instance.

The driver (rank 0) lives in the engine's process; ranks 1..N-1 are hosted by a
``WorkerLauncher`` (plain processes here; Ray actors can host them through the same interface).
Each step the driver broadcasts the step message over the CPU group, then every shard runs the
same forward pass and the logits meet on the driver.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
from abc import ABC, abstractmethod
from pathlib import Path

import msgpack
import torch

from common.config import EngineConfig
from engine.distributed.parallel import TensorParallel, pick_device
from engine.model_runner import ModelRunner, check_model
from engine.step_input import StepInput

logger = logging.getLogger(__name__)


class WorkerHandle(ABC):
    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def join(self, timeout_s: float) -> None:
        """Wait for a clean exit; kill the worker if it has not exited by then."""


class WorkerLauncher(ABC):
    """Starts shard processes. ``launch`` must not block on the shard's start-up."""

    @abstractmethod
    def launch(self, rank: int, world_size: int, init_method: str, config: dict, model_dir: str) -> WorkerHandle: ...


class _ProcessHandle(WorkerHandle):
    def __init__(self, process: mp.process.BaseProcess) -> None:
        self.process = process

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def join(self, timeout_s: float) -> None:
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


class ProcessLauncher(WorkerLauncher):
    def launch(self, rank, world_size, init_method, config, model_dir) -> WorkerHandle:
        process = mp.get_context("spawn").Process(
            target=run_worker,
            args=(rank, world_size, init_method, config, model_dir),
            name=f"pdserve-shard-{rank}",
            daemon=True,
        )
        process.start()
        return _ProcessHandle(process)


def _threads_per_shard(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def run_worker(rank: int, world_size: int, init_method: str, config: dict, model_dir: str) -> None:
    """Entry point of shard ``rank`` > 0: build the runner, then execute the driver's steps until told to stop."""
    engine_config = EngineConfig.from_dict(config)
    torch.set_num_threads(_threads_per_shard(world_size))
    device = pick_device(engine_config.model.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
    tp = TensorParallel.init(rank, world_size, init_method, device, engine_config.parallel.distributed_timeout_s)
    try:
        runner = ModelRunner(engine_config, Path(model_dir), tp)
        while True:
            message = msgpack.unpackb(tp.broadcast_bytes(None))
            if message["op"] == "step":
                runner.execute(StepInput.from_dict(message["step"]))
            elif message["op"] == "shutdown":
                break
    finally:
        tp.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Executor:
    def __init__(self, config: EngineConfig, model_dir: Path, launcher: WorkerLauncher | None = None) -> None:
        check_model(config, model_dir)
        self.world_size = config.parallel.tensor_parallel_size
        device = pick_device(config.model.device)
        self.workers: list[WorkerHandle] = []
        if self.world_size == 1:
            tp = TensorParallel.single(device)
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            launcher = launcher or ProcessLauncher()
            payload = config.to_dict()
            for rank in range(1, self.world_size):
                self.workers.append(launcher.launch(rank, self.world_size, init_method, payload, str(model_dir)))
            torch.set_num_threads(_threads_per_shard(self.world_size))
            if device.type == "cuda":
                device = torch.device("cuda", 0)
            tp = TensorParallel.init(0, self.world_size, init_method, device, config.parallel.distributed_timeout_s)
        self.tp = tp
        try:
            self.driver = ModelRunner(config, model_dir, tp)
        except BaseException:
            self.shutdown()
            raise
        self._closed = False

    def execute(self, step: StepInput) -> torch.Tensor | None:
        if self.world_size > 1:
            self._check_workers()
            self.tp.broadcast_bytes(msgpack.packb({"op": "step", "step": step.to_dict()}))
        return self.driver.execute(step)

    def _check_workers(self) -> None:
        dead = [i + 1 for i, w in enumerate(self.workers) if not w.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel shard(s) {dead} died; the model instance must be restarted")

    def shutdown(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.world_size > 1:
            try:
                if all(w.is_alive() for w in self.workers):
                    self.tp.broadcast_bytes(msgpack.packb({"op": "shutdown"}))
            finally:
                for worker in self.workers:
                    worker.join(timeout_s=10)
                self.tp.destroy()
