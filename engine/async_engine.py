"""An LLMEngine driven by its own thread, for asyncio callers (the pools' Serve replicas).

    coroutine ──call(fn)──▶ bounded command queue ──▶ engine thread: run commands, step, dispatch
    coroutine ◀──────────── per-request asyncio.Queue ◀── RequestOutput of each step

Every engine access happens on the engine thread, between steps, so the engine needs no locks.
The thread steps while there is work and sleeps on the command queue otherwise; while only KV
hand-offs are open it polls them every ``idle_poll_s`` instead of spinning. A step that raises
leaves the engine unusable: every open stream ends with the error and ``is_healthy`` turns false,
so the host can be restarted.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from common.errors import OverloadedError
from common.outputs import CompletionOutput, RequestOutput
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")
_MAX_KV_EVENTS = 4096


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue  # bounded by the request's own length: at most one item per engine step


@dataclass(slots=True)
class HandoffWatch:
    """A prefill-role request whose caller waits until its KV hand-off has ended."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    output: RequestOutput | None = None  # the finished (prefilled) output, once seen


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_pending_commands: int = 4096, idle_poll_s: float = 0.002) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue(maxsize=max_pending_commands)
        self._streams: dict[str, _Stream] = {}
        self._handoffs: dict[str, HandoffWatch] = {}
        self._idle_poll_s = idle_poll_s
        self._stopping = threading.Event()
        self.error: str | None = None  # why the engine thread stopped, if it failed
        self.num_steps = 0
        # Published by the engine thread after every step, so a report never waits for a long step.
        self.snapshot: dict[str, Any] = load_report(engine)
        self.kv_events: collections.deque = collections.deque(maxlen=_MAX_KV_EVENTS)
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    # --- called from coroutines --------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T], timeout_s: float = 60.0) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its exception is re-raised here."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._commands.put_nowait((fn, future))
        except queue.Full:
            raise OverloadedError("the engine's command queue is full; retry later") from None
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """Register a request's output queue; call before the request can produce output."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        return stream.outputs

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def stream(
        self, request_id: str, outputs: asyncio.Queue, item_timeout_s: float
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; abort it if the consumer goes away first."""
        finished = False
        try:
            while not finished:
                output: RequestOutput = await asyncio.wait_for(outputs.get(), item_timeout_s)
                finished = output.finished
                yield output
        finally:
            self.close_stream(request_id)
            if not finished:
                self.abort_soon(request_id)

    def watch_handoff(self, engine: LLMEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """Prefill role, on the engine thread (inside ``call``, before the request is added): a future
        resolved with (finished output, failure or None) once the request's KV hand-off ends."""
        watch = HandoffWatch(loop, loop.create_future())
        self._handoffs[request_id] = watch
        return watch.future

    def abort_soon(self, request_id: str, error: str | None = None) -> None:
        """Abort without waiting (cancellation paths cannot await). Its hand-off watch, if any, is
        dropped on the engine thread, which alone touches that table."""

        def abort(engine: LLMEngine) -> None:
            self._handoffs.pop(request_id, None)
            engine.abort_request(request_id, error)

        try:
            self._commands.put_nowait((abort, None))
        except queue.Full:
            logger.error("%s: command queue full, abort dropped", request_id)

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._stopping.set()
        with contextlib.suppress(queue.Full):
            self._commands.put_nowait((lambda e: None, None))  # wake the thread
        self._thread.join(timeout_s)
        self.engine.shutdown()

    # --- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished_requests()
                if self._run_commands(block=not busy):
                    self._publish()
                if self._stopping.is_set():
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                self.num_steps += 1
                self._publish()  # before the outputs go out: a caller that sees them sees this state
                self._dispatch(outputs)
                self._check_handoffs()
                if not outputs and not self.engine.scheduler.running and not self.engine.scheduler.waiting:
                    time.sleep(self._idle_poll_s)  # only hand-offs are open: poll, don't spin
        except BaseException as exc:  # the engine is unusable: fail everyone, loudly
            self.error = f"{type(exc).__name__}: {exc}"
            logger.exception("engine thread failed")
            self._fail_all(self.error)

    def _publish(self) -> None:
        self.snapshot = load_report(self.engine)
        self.kv_events.extend(self.engine.take_kv_events())  # bounded: the oldest fall off

    def _run_commands(self, block: bool) -> int:
        """Run the queued commands (waiting up to 0.1 s for one when ``block``); how many ran."""
        timeout = 0.1 if block else None
        num_run = 0
        while True:
            try:
                fn, future = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return num_run
            num_run += 1
            block = False  # after the first command, drain without waiting
            if future is None:
                try:
                    fn(self.engine)
                except Exception:
                    logger.exception("engine command failed")
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:
                future.set_exception(exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, output)
            watch = self._handoffs.get(output.request_id)
            if watch is not None and output.finished:
                watch.output = output

    def _check_handoffs(self) -> None:
        engine = self.engine
        for request_id in [r for r in engine.transfer_failures if r not in self._handoffs]:
            del engine.transfer_failures[request_id]  # nobody waits for it (aborted): only logged
        for request_id, watch in list(self._handoffs.items()):
            if watch.output is None:
                continue
            failure = engine.transfer_failures.pop(request_id, None)
            if failure is None and request_id in engine.scheduler.handoff:
                continue  # still sending
            if watch.output.error is not None:
                failure = watch.output.error
            del self._handoffs[request_id]
            _resolve(watch.loop, watch.future, (watch.output, failure))

    def _fail_all(self, error: str) -> None:
        for request_id, stream in list(self._streams.items()):
            completion = CompletionOutput(0, "", [], finish_reason="error")
            failed = RequestOutput(request_id, None, [], [completion], finished=True, error=error)
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, failed)
        for watch in list(self._handoffs.values()):
            _resolve(watch.loop, watch.future, (None, error))
        self._handoffs.clear()
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(f"the engine stopped: {error}"))


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
    def _set() -> None:
        if not future.done():
            future.set_result(value)

    loop.call_soon_threadsafe(_set)


def load_report(engine: LLMEngine) -> dict[str, Any]:
    """The load and cache figures of a replica's report (common.serving.ReplicaReport fields)."""
    stats = engine.stats()
    return {
        "role": engine.role.value,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_reserved": stats.num_reserved,
        "num_kv_blocks_free": stats.kv.num_free_blocks,
        "num_kv_blocks_total": stats.kv.num_blocks,
        "num_blocks_held": engine.num_blocks_held(),
        "max_model_len": engine.max_model_len,
        "prefix_cache_hit_rate": stats.kv.hit_rate,
    }
