"""Runs a step on every shard of a model instance.

The driver (rank 0) lives in the engine's process; ranks 1..N-1 are hosted by a
``WorkerLauncher`` (plain processes here; Ray actors can host them through the same interface).
Each step the driver broadcasts the step message over the CPU group, then every shard runs the
same forward pass and the logits meet on the driver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import msgpack
import torch
import torch.distributed as dist

from common.config import EngineConfig
from common.cpu_cores import host_cores, pin_process, split_cores
from common.errors import ConfigError
from common.kv_messages import ConnectorStep, ShardReport
from engine.distributed.parallel import TensorParallel, pick_device, shard_device
from engine.dtype_probe import resolve_auto_dtype
from engine.model_runner import ModelRunner, check_model
from engine.step_input import CarriedTokens, StepInput

logger = logging.getLogger(__name__)
# How long shutdown lets a step's thread leave its collective once the shards are gone.
_STEP_LEAVE_WAIT_S = 10.0
# How often the watchdog asks whether every shard still runs (a process poll or a Ray wait of 0 s).
_SHARD_WATCH_PERIOD_S = 0.5


class WorkerHandle(ABC):
    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def join(self, timeout_s: float) -> None:
        """Wait for a clean exit; kill the worker if it has not exited by then."""


class WorkerLauncher(ABC):
    """Starts shard processes. ``launch`` must not block on the shard's start-up."""

    # True where each shard's process is given a device of its own (Ray's GPU per shard actor):
    # the driver's process then sees one GPU however many shards there are.
    assigns_devices: bool = False

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
    """Shard processes on this host; each pins itself to its own slice of the instance's cores."""

    def launch(self, rank, world_size, init_method, config, model_dir) -> WorkerHandle:
        process = mp.get_context("spawn").Process(
            target=run_worker,
            args=(rank, world_size, init_method, config, model_dir, True),
            name=f"pdserve-shard-{rank}",
            daemon=True,
        )
        process.start()
        return _ProcessHandle(process)


@dataclasses.dataclass(frozen=True)
class HostCores:
    """A process's torch thread count and core affinity. A TP driver in its host's process sets
    both to its slice (``use_cores``); an offline engine gives them back when it shuts down, or a
    script (or a test suite) that closed a TP=2 engine ran everything after it on one thread."""

    threads: int
    affinity: frozenset[int] | None

    @classmethod
    def now(cls) -> HostCores:
        affinity = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return cls(torch.get_num_threads(), affinity)

    def restore(self) -> None:
        if self.affinity is not None and frozenset(os.sched_getaffinity(0)) != self.affinity:
            pin_process(sorted(self.affinity))
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


def instance_cores(config: EngineConfig) -> list[int]:
    """The cores the whole instance runs on: those it was given (a serving replica's claim), else
    every core this process may use (an offline engine takes the machine)."""
    return list(config.parallel.cpu_cores or host_cores())


def use_cores(rank: int, world_size: int, cores: list[int], pin: bool) -> list[int]:
    """Before any torch work of shard ``rank``: its slice of ``cores``, as its torch/OpenMP thread
    count and, with ``pin``, as the affinity of its whole process (threads inherit it)."""
    mine = split_cores(rank, world_size, cores)
    if pin:
        pin_process(mine)
    torch.set_num_threads(max(1, len(mine)))
    return mine


def run_worker(
    rank: int, world_size: int, init_method: str, config: dict, model_dir: str, own_process: bool = False
) -> None:
    """Entry point of shard ``rank`` > 0: build the runner, then execute the driver's steps until told to stop.

    Pinned to its slice of the instance's cores when the instance was given cores, or when
    ``own_process`` (a ProcessLauncher child, whose affinity is its driver's); a host's process
    (a Ray actor of an unpinned replica) keeps its affinity and only sets its thread count."""
    engine_config = EngineConfig.from_dict(config)
    device = pick_device(engine_config.model.device)
    if device.type == "cpu":
        use_cores(
            rank, world_size, instance_cores(engine_config), pin=own_process or bool(engine_config.parallel.cpu_cores)
        )
    device = shard_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    timeout = datetime.timedelta(seconds=engine_config.parallel.distributed_timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    store.set(_shard_pid_key(rank), str(os.getpid()))  # before joining: the driver reads it once all joined
    threading.Thread(target=_beat, args=(host, int(port), rank), name="pdserve-shard-heartbeat", daemon=True).start()
    store.add(_JOINED_KEY, 1)
    tp = TensorParallel.init(rank, world_size, store, device, engine_config.parallel.distributed_timeout_s)
    runner = None
    try:
        runner = ModelRunner(engine_config, Path(model_dir), tp)
        has_connector = runner.connector is not None
        if has_connector:
            tp.gather_bytes_to_driver((runner.connector.endpoint or "").encode())
        while True:
            message = msgpack.unpackb(tp.broadcast_bytes(None))
            op = message["op"]
            if op == "step":
                plan = message.get("connector")
                runner.execute(StepInput.from_dict(message["step"]), ConnectorStep.from_wire(plan) if plan else None)
            elif op == "connector":  # no forward pass: only move KV bookkeeping forward
                if runner.connector is not None:
                    runner.connector.start_step(ConnectorStep.from_wire(message["connector"]))
            elif op == "shutdown":
                break
            if has_connector and op in ("step", "connector"):
                report = runner.connector_report(None).to_wire()
                tp.gather_bytes_to_driver(msgpack.packb(report, use_bin_type=True))
    finally:
        if runner is not None:
            runner.close()
        tp.destroy()


_JOINED_KEY = "pdserve/shards_joined"
_HEARTBEAT_PERIOD_S = 0.5


def _heartbeat_key(rank: int) -> str:
    return f"pdserve/heartbeat/{rank}"


def _beat(host: str, port: int, rank: int) -> None:
    """A shard's heartbeat: a counter in the driver's store, bumped every _HEARTBEAT_PERIOD_S on a
    thread of its own (a store client of its own too), so a stopped or frozen shard is told from a
    busy one. Ends with the store (the driver gone)."""
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
        while True:
            store.add(_heartbeat_key(rank), 1)
            time.sleep(_HEARTBEAT_PERIOD_S)
    except Exception:
        return


def _shard_pid_key(rank: int) -> str:
    return f"pdserve/shard_pid/{rank}"


def _wait_for_shards(store: dist.TCPStore, workers: list[WorkerHandle], timeout_s: float) -> None:
    """Block until every launched shard reached the store; fail fast, naming it, if one exits first."""
    deadline = time.monotonic() + timeout_s
    while store.add(_JOINED_KEY, 0) < len(workers):
        dead = [rank for rank, w in enumerate(workers, start=1) if not w.is_alive()]
        if dead:
            raise RuntimeError(
                f"tensor-parallel shard(s) {dead} exited during start-up (see their traceback above). When "
                "LLM(tensor_parallel_size>1) runs from a script, guard it with `if __name__ == '__main__':` "
                "(shards are started with multiprocessing's spawn)"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor-parallel shards did not start within {timeout_s:.0f} s")
        time.sleep(0.05)


def _check_gpus(device: torch.device, world_size: int, launcher: WorkerLauncher) -> None:
    """Every shard on a GPU of its own: refused before any starts where this process's GPUs cannot
    hold them (two shards on one GPU would fail NCCL's set-up; an index past the last GPU is a typo)."""
    visible = torch.cuda.device_count()
    if visible == 0:
        raise ConfigError(f"device={device} but no CUDA GPU is visible to this process")
    if launcher.assigns_devices:
        return  # each shard's process is handed its own (Ray: one GPU per shard actor)
    first = device.index or 0
    if first + world_size > visible:
        raise ConfigError(
            f"device={device} with tensor_parallel_size={world_size} needs GPUs {first}..{first + world_size - 1}; "
            f"{visible} visible"
        )


class Executor:
    def __init__(self, config: EngineConfig, model_dir: Path, launcher: WorkerLauncher | None = None) -> None:
        check_model(config, model_dir)
        device = pick_device(config.model.device)
        if config.model.dtype == "auto":  # resolved once here: every shard must run the same dtype
            model = dataclasses.replace(config.model, dtype=resolve_auto_dtype(device))
            config = dataclasses.replace(config, model=model)
        self.world_size = config.parallel.tensor_parallel_size
        # What the host process had before the driver took its slice: given back at shutdown, or
        # at once if the instance never starts.
        self._host_cores: HostCores | None = None
        if device.type == "cpu" and (self.world_size > 1 or config.parallel.cpu_cores):
            # The driver shares its process with its host (an offline script, a serving replica):
            # pinned only to cores given to it, never to a slice of cores it was not given.
            self._host_cores = HostCores.now()
            use_cores(0, self.world_size, instance_cores(config), pin=bool(config.parallel.cpu_cores))
        try:
            self._start(config, model_dir, launcher, device)
        except BaseException:
            if self._host_cores is not None:
                self._host_cores.restore()
            raise

    def _start(
        self, config: EngineConfig, model_dir: Path, launcher: WorkerLauncher | None, device: torch.device
    ) -> None:
        self.workers: list[WorkerHandle] = []
        self.shard_pids: list[int] = []  # ranks 1.., for operators (whichever launcher started them)
        self._broken = False  # a step failed midway: shards may be stuck in a collective
        self._steps_in_flight = 0  # inside _guard: a thread may be in a collective right now
        self._step_left = threading.Condition()
        self.failure: str | None = None  # set by the watchdog when a shard died
        # Called by the watchdog with ``failure``: the step thread may stay in a collective with the
        # dead shard until distributed_timeout_s, and its callers should not wait that long.
        self.on_failure: Callable[[str], None] | None = None
        self._watch_stop = threading.Event()
        launcher = launcher or ProcessLauncher()
        if device.type == "cuda":
            _check_gpus(device, self.world_size, launcher)
            device = shard_device(device, 0)
            torch.cuda.set_device(device)
        if self.world_size == 1:
            tp = TensorParallel.single(device)
        else:
            timeout_s = config.parallel.distributed_timeout_s
            # Rank 0 serves the rendezvous store on a port the OS picks: no port race. TCPStore would
            # bind every interface whatever host it is given, so it gets a loopback socket of ours.
            listener = socket.create_server(("127.0.0.1", 0), backlog=max(128, self.world_size))
            try:
                store = dist.TCPStore(
                    "127.0.0.1",
                    listener.getsockname()[1],
                    self.world_size,
                    is_master=True,
                    timeout=datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False,
                    master_listen_fd=listener.fileno(),
                )
            except BaseException:
                listener.close()
                raise
            listener.detach()  # the store owns the socket from here on
            init_method = f"tcp://127.0.0.1:{store.port}"
            payload = config.to_dict()
            for rank in range(1, self.world_size):
                self.workers.append(launcher.launch(rank, self.world_size, init_method, payload, str(model_dir)))
            try:
                _wait_for_shards(store, self.workers, timeout_s)
                self.shard_pids = [int(store.get(_shard_pid_key(rank))) for rank in range(1, self.world_size)]
                tp = TensorParallel.init(0, self.world_size, store, device, timeout_s)
            except BaseException:
                self._kill_workers()
                raise
        self.tp = tp
        if self.workers:
            watch = (store.port, config.parallel.shard_heartbeat_timeout_s)
            threading.Thread(target=self._watch_shards, args=watch, name="pdserve-shard-watch", daemon=True).start()
        try:
            self.driver = ModelRunner(config, model_dir, tp)
            self.has_connector = self.driver.connector is not None
            # Every shard's KV endpoint, rank order: what a decode ticket names.
            self.connector_endpoints: list[str] = []
            if self.has_connector:
                endpoints = tp.gather_bytes_to_driver((self.driver.connector.endpoint or "").encode())
                self.connector_endpoints = [e.decode() for e in endpoints or []]
        except BaseException:
            self._broken = True  # the shards may be inside a start-up collective: kill, do not talk
            self.shutdown()
            raise
        self._closed = False

    def execute(
        self, step: StepInput, connector_step: ConnectorStep | None = None, carried: CarriedTokens | None = None
    ) -> torch.Tensor | None:
        """The forward pass on every shard. With a connector, ``finish_step`` must follow.
        ``carried`` (input ids still on the driver's device) needs a single shard."""
        assert carried is None or self.world_size == 1, "a step ahead runs on one shard only"
        with self._guard():
            if self.world_size > 1:
                plan = connector_step.to_wire() if connector_step is not None else None
                message = {"op": "step", "step": step.to_dict(), "connector": plan}
                self.tp.broadcast_bytes(msgpack.packb(message, use_bin_type=True))
            return self.driver.execute(step, connector_step, carried)

    def connector_step(self, plan: ConnectorStep) -> None:
        """A step without a forward pass, to register or forget transfers and poll progress."""
        with self._guard():
            if self.world_size > 1:
                message = {"op": "connector", "connector": plan.to_wire()}
                self.tp.broadcast_bytes(msgpack.packb(message, use_bin_type=True))
            assert self.driver.connector is not None
            self.driver.connector.start_step(plan)

    def finish_step(self, sampled: dict[str, int] | None) -> list[ShardReport]:
        """Every shard's connector report for the step just run (rank order)."""
        with self._guard():
            own = self.driver.connector_report(sampled)
            if self.world_size == 1:
                return [own]
            # msgpack only for the other shards' reports: they cross a process.
            others = (self.tp.gather_bytes_to_driver(b"") or [])[1:]
        return [own, *(ShardReport.from_wire(msgpack.unpackb(r, raw=False)) for r in others)]

    def mark_broken(self) -> None:
        """A failure outside a step's collectives left the shards out of step (e.g. the sampler's, on
        the driver, after the forward pass): shutdown kills them instead of talking to them."""
        self._broken = True

    @contextlib.contextmanager
    def _guard(self):
        """Any failure or interrupt inside a step leaves the shards out of step with the driver: the
        instance is then unusable, and shutdown kills the shards instead of talking to them."""
        if self._broken:
            raise RuntimeError("this model instance failed during an earlier step; restart it")
        self._check_workers()
        with self._step_left:
            self._steps_in_flight += 1
        try:
            yield
        except torch.OutOfMemoryError:
            # One shard ran out of memory in its own forward pass: nothing is out of step (the
            # engine ends that step's requests). With more shards, the others may be inside the
            # step's collectives: broken as any failure.
            self._broken = self._broken or self.world_size > 1
            raise
        except BaseException:
            self._broken = True
            raise
        finally:
            with self._step_left:
                self._steps_in_flight -= 1
                self._step_left.notify_all()

    def _check_workers(self) -> None:
        self.check_shards()
        dead = self._dead_ranks()
        if dead:
            raise RuntimeError(f"tensor-parallel shard(s) {dead} died; the model instance must be restarted")

    def check_shards(self) -> None:
        """Raise if the watchdog found a dead shard (cheap: no question to the shards)."""
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def _dead_ranks(self) -> list[int]:
        return [rank for rank, worker in enumerate(self.workers, 1) if not worker.is_alive()]

    def _watch_shards(self, store_port: int, heartbeat_timeout_s: float) -> None:
        """A dead or hung shard can leave the driver blocked in a collective for
        ``distributed_timeout_s``: gloo fails an operation on a peer's closed socket, but a live
        shard whose own collective failed (a Ray actor outlives its failed call) keeps its sockets
        open while the driver waits on it, and so does a stopped (SIGSTOP) or frozen one, found by
        its heartbeat going quiet. Killing every shard then closes each socket the driver may wait
        on, so the step fails now and the instance reports the failure (NCCL waits regardless: the
        replica's health check sees ``failure`` and the replica is replaced)."""
        try:
            store: dist.TCPStore | None = dist.TCPStore(
                "127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=10)
            )
        except Exception:  # the store is gone already (shut down during start-up): deaths are still seen
            logger.exception("the shard watchdog could not reach the store: heartbeats unread")
            store = None
        ranks = range(1, self.world_size)
        beats = {rank: -1 for rank in ranks}
        heard = dict.fromkeys(ranks, time.monotonic())  # this driver's clock, when each beat last moved
        while not self._watch_stop.wait(_SHARD_WATCH_PERIOD_S):
            try:
                dead = self._dead_ranks()
                now = time.monotonic()
                for rank in ranks if store is not None else ():
                    beat = store.add(_heartbeat_key(rank), 0)
                    if beat != beats[rank]:
                        beats[rank], heard[rank] = beat, now
            except Exception:  # a launcher's liveness question failed: ask again next time
                logger.exception("could not ask the tensor-parallel shards whether they run")
                continue
            silent = [rank for rank in ranks if now - heard[rank] > heartbeat_timeout_s]
            if dead:
                self.failure = f"tensor-parallel shard(s) {dead} died; the model instance must be restarted"
            elif silent and not self._watch_stop.is_set():
                self.failure = (
                    f"tensor-parallel shard(s) {silent} stopped answering (no heartbeat for "
                    f"{heartbeat_timeout_s:g} s: stopped or frozen); the model instance must be restarted"
                )
            else:
                continue
            logger.error("%s: stopping every other shard so that no step waits on them", self.failure)
            self._kill_workers()
            if self.on_failure is not None:
                self.on_failure(self.failure)
            return

    def shutdown(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._watch_stop.set()  # shards that exit now are shut down, not dead
        if self.world_size > 1 and self._steps_in_flight:
            # A step's thread is still in a collective (a shard died, or we are shutting down
            # under it). Its shards go first, so the collective fails and the thread leaves; only
            # then are the caches and the group freed. gloo's operations cannot be interrupted and
            # have been seen to outwait a dead peer: past the bound they are freed regardless.
            self._kill_workers()
            with self._step_left:
                if not self._step_left.wait_for(lambda: not self._steps_in_flight, _STEP_LEAVE_WAIT_S):
                    logger.warning("shutting down with a step still in a collective after %.0f s", _STEP_LEAVE_WAIT_S)
        if getattr(self, "driver", None) is not None:
            self.driver.close()
        if self.world_size > 1:
            try:
                if not self._broken and all(w.is_alive() for w in self.workers):
                    self.tp.broadcast_bytes(msgpack.packb({"op": "shutdown"}))
                    for worker in self.workers:
                        worker.join(timeout_s=10)
            finally:
                self._kill_workers()
                self.tp.destroy()  # local teardown only, safe once the shards are gone
        if getattr(self, "_host_cores", None) is not None:
            self._host_cores.restore()
            self._host_cores = None

    def _kill_workers(self) -> None:
        for worker in self.workers:
            worker.join(timeout_s=0)  # kills it if it is still running
