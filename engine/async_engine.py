"""An LLMEngine driven by its own thread, for asyncio callers (the pools' Serve replicas).

    coroutine ──call(fn)──▶ bounded command queue ──▶ engine thread: run commands, step, dispatch
    coroutine ◀──────────── per-request asyncio.Queue ◀── RequestOutput of each step

Every engine access happens on the engine thread, between steps, so the engine needs no locks.
The thread steps while there is work and sleeps on the command queue otherwise; while only KV
hand-offs are open it polls them every ``idle_poll_s`` instead of spinning, and after a step that
finished prompts it waits a moment for their hand-offs before the next step. A step that raises
leaves the engine unusable: every open stream ends with the error and ``is_healthy`` turns false,
so the host can be restarted.

``call_when_room`` is for work that needs KV blocks the engine does not have free yet (a decode
reservation during a burst): it waits in a bounded FIFO and is tried again, head first, only after
blocks were freed — no polling — until its deadline; only a full queue or a passed deadline
refuses it (OverloadedError, which the API answers with 503 + Retry-After).
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

from common.errors import EngineStopped, OverloadedError
from common.outputs import CompletionOutput, RequestOutput
from engine.handoff.watches import HandoffWatches
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")
_MAX_KV_EVENTS = 4096
_ROOM_WAIT_MARGIN_S = 5.0


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue  # bounded by the request's own length: at most one item per engine step


@dataclass(slots=True)
class _RoomWaiter:
    """A ``call_when_room`` function waiting for free KV blocks (engine thread only)."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future
    deadline: float  # time.monotonic()


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        max_pending_commands: int = 4096,
        idle_poll_s: float = 0.002,
        max_waiting_for_room: int = 256,
    ) -> None:
        """``engine``, or a function that builds it: then it is built on the engine thread (and
        this waits for it), so one thread of the process runs all its parallel tensor work — the
        model load included — and owns the only OpenMP team (see common.openmp)."""
        self._commands: queue.Queue = queue.Queue(maxsize=max_pending_commands)
        self.max_waiting_for_room = max_waiting_for_room
        self._room_slots = threading.BoundedSemaphore(max_waiting_for_room)
        self._room_waiters: collections.deque[_RoomWaiter] = collections.deque()  # engine thread only
        self._missed: tuple[_RoomWaiter, int] | None = None  # the head that last did not fit, and free blocks then
        self._streams: dict[str, _Stream] = {}
        self._handoffs = HandoffWatches(idle_poll_s)  # prefill role: callers waiting for hand-offs' ends
        self._idle_poll_s = idle_poll_s
        self._stopping = threading.Event()
        self.error: str | None = None  # why the engine thread stopped, if it failed
        self.num_steps = 0
        self.kv_events: collections.deque = collections.deque(maxlen=_MAX_KV_EVENTS)
        self.kv_events_lost = 0  # events that fell off kv_events unread (see cached_block_hashes)
        self.engine: LLMEngine
        # Published by the engine thread after every step, so a report never waits for a long step.
        self.snapshot: dict[str, Any]
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(engine, built), name="pdserve-engine", daemon=True)
        self._thread.start()
        try:
            built.result()
        except BaseException:  # the build failed (the thread has returned), or this wait was interrupted
            self._stop_thread()
            self._thread.join()
            if built.done() and built.exception() is None:
                self.engine.shutdown()
            raise

    # --- called from coroutines --------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T], timeout_s: float = 60.0) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its exception is re-raised here."""
        if self.error is not None:
            raise EngineStopped(f"the engine stopped: {self.error}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._commands.put_nowait((fn, future))
        except queue.Full:
            raise OverloadedError("the engine's command queue is full; retry later") from None
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)

    async def call_when_room(self, fn: Callable[[LLMEngine], T | None], timeout_s: float) -> T:
        """Run ``fn(engine)`` on the engine thread; while it returns None (no room yet), wait in the
        FIFO and try again after blocks are freed. Raises OverloadedError when the FIFO is full or
        ``timeout_s`` passes first; ``fn``'s own exception is re-raised here. A caller that leaves
        (cancelled) may find ``fn`` already done: it must undo it (the decode replica aborts)."""
        if self.error is not None:
            raise EngineStopped(f"the engine stopped: {self.error}")
        if not self._room_slots.acquire(blocking=False):
            raise OverloadedError(
                f"{self.max_waiting_for_room} requests are already waiting for KV blocks on this replica; retry later"
            )
        waiter = _RoomWaiter(fn, concurrent.futures.Future(), time.monotonic() + timeout_s)
        try:
            self._commands.put_nowait((lambda e: self._room_waiters.append(waiter), None))
        except queue.Full:
            self._room_slots.release()
            raise OverloadedError("the engine's command queue is full; retry later") from None
        # From here on only the engine thread frees the place (served, expired, dropped, failed).
        try:
            # The engine thread resolves it by its deadline; the margin only guards a thread gone.
            return await asyncio.wait_for(asyncio.wrap_future(waiter.future), timeout_s + _ROOM_WAIT_MARGIN_S)
        except asyncio.TimeoutError:
            waiter.future.cancel()
            raise OverloadedError("no KV blocks came free in time for this request; retry later") from None
        except BaseException:
            # At once, not via asyncio's callback: if the engine thread has not served it yet it
            # never will, and if it has, the caller's abort (queued after this) undoes it.
            waiter.future.cancel()
            raise

    @property
    def num_waiting_for_room(self) -> int:
        return len(self._room_waiters)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """Register a request's output queue; call before the request can produce output."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        return stream.outputs

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def stream(
        self, request_id: str, outputs: asyncio.Queue, item_timeout_s: float
    ) -> AsyncIterator[list[RequestOutput]]:
        """Yield the request's outputs until it finishes, those already queued together (a consumer
        slower than the engine's steps catches up in one item, not one per step); abort the request
        if the consumer goes away first."""
        finished = False
        try:
            while not finished:
                batch: list[RequestOutput] = [await asyncio.wait_for(outputs.get(), item_timeout_s)]
                while not batch[-1].finished and not outputs.empty():
                    batch.append(outputs.get_nowait())
                finished = batch[-1].finished
                yield batch
        finally:
            self.close_stream(request_id)
            if not finished:
                self.abort_soon(request_id)

    def watch_handoff(self, engine: LLMEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """Prefill role, on the engine thread (inside ``call``, before the request is added): a future
        resolved with a HandoffEnded once the request's KV hand-off ends."""
        return self._handoffs.watch(request_id, loop)

    async def cached_block_hashes(self) -> tuple[list[bytes], int]:
        """Every block hash in the prefix cache now, and ``kv_events_lost`` then; on the engine
        thread, which alone adds events, so that replaying ``kv_events`` from here on is exact
        (the events the snapshot already reflects are dropped with it)."""

        def snapshot(engine: LLMEngine) -> tuple[list[bytes], int]:
            engine.take_kv_events()
            self.kv_events.clear()
            return list(engine.kv.pool.cached), self.kv_events_lost

        return await self.call(snapshot, timeout_s=30)

    def abort_soon(self, request_id: str, error: str | None = None) -> None:
        """Abort without waiting (cancellation paths cannot await). Its hand-off watch, if any, is
        dropped on the engine thread, which alone touches that table."""

        def abort(engine: LLMEngine) -> None:
            self._handoffs.drop(request_id)
            engine.abort_request(request_id, error)

        try:
            self._commands.put_nowait((abort, None))
        except queue.Full:
            logger.error("%s: command queue full, abort dropped", request_id)

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._stop_thread()
        self._thread.join(timeout_s)
        self.engine.shutdown()

    def _stop_thread(self) -> None:
        self._stopping.set()
        with contextlib.suppress(queue.Full):
            self._commands.put_nowait((lambda e: None, None))  # wake the thread

    # --- the engine thread -------------------------------------------------------------------
    def _run(self, build: LLMEngine | Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        try:
            self.engine = build if isinstance(build, LLMEngine) else build()
            self.snapshot = {**load_report(self.engine), "report_time": time.time()}
        except BaseException as exc:
            built.set_exception(exc)
            return
        self.engine.executor.on_failure = self._fail_streams_now
        built.set_result(None)
        try:
            while not self._stopping.is_set():
                self.engine.check_shards()  # an idle engine fails too: its health check tells Serve
                busy = self.engine.has_unfinished_requests()
                if self._run_commands(block=not busy):
                    self._publish()
                self._serve_room_waiters()
                if self._stopping.is_set():
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                step_started = time.monotonic()
                outputs = self.engine.step()
                self.num_steps += 1
                self._publish()  # before the outputs go out: a caller that sees them sees this state
                self._dispatch(outputs)
                self._handoffs.settle(self.engine)
                self._handoffs.wait_for_acknowledgements(self.engine, time.monotonic() - step_started)
                self._serve_room_waiters()
                if not outputs and not self.engine.scheduler.running and not self.engine.scheduler.waiting:
                    time.sleep(self._idle_poll_s)  # only hand-offs are open: poll, don't spin
        except BaseException as exc:  # the engine is unusable: fail everyone, loudly
            # A shard the watchdog found dead or silent is the cause: the collective's own error
            # (a closed socket) only names its symptom.
            cause = self.engine.executor.failure
            self.error = cause if cause is not None else f"{type(exc).__name__}: {exc}"
            logger.exception("engine thread failed")
            self._fail_all(self.error)
            return
        while self._room_waiters:  # shut down: nobody will serve them
            self._finish_waiter(self._room_waiters.popleft(), error=RuntimeError("the engine is shutting down"))

    def _publish(self) -> None:
        # report_time: when these figures were true (the router counts what it sent after it).
        waiting = len(self._room_waiters)
        self.snapshot = {**load_report(self.engine), "num_waiting_for_blocks": waiting, "report_time": time.time()}
        events = self.engine.take_kv_events()
        # Bounded: the oldest fall off, counted, so that whoever replays them knows to resync.
        kv_events = self.kv_events
        self.kv_events_lost += max(0, len(kv_events) + len(events) - (kv_events.maxlen or len(events)))
        kv_events.extend(events)

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

    def _serve_room_waiters(self) -> None:
        """Strict FIFO: the head is tried only when blocks were freed since it last missed, and
        nobody passes it (a long prompt is not starved by short ones). Waiters past their
        deadline, or whose caller left, leave the queue wherever they stand."""
        if not self._room_waiters:
            return
        now = time.monotonic()
        gone = [w for w in self._room_waiters if w.deadline < now or w.future.cancelled()]
        if gone:
            self._room_waiters = collections.deque(
                w for w in self._room_waiters if w.deadline >= now and not w.future.cancelled()
            )
            for waiter in gone:  # after the queue no longer holds them: a woken caller sees it so
                # (a cancelled one only frees its place: its future cannot be set)
                self._finish_waiter(
                    waiter, error=OverloadedError("no KV blocks came free in time for this request; retry later")
                )
        while self._room_waiters:
            free = self.engine.num_free_kv_blocks
            waiter = self._room_waiters[0]
            if self._missed is not None and self._missed[0] is waiter and free <= self._missed[1]:
                return  # nothing was freed since the head last missed: it would miss again
            if waiter.future.cancelled():  # its caller left: never run fn (see call_when_room)
                self._room_waiters.popleft()
                self._room_slots.release()
                continue
            try:
                result = waiter.fn(self.engine)
            except Exception as exc:
                self._room_waiters.popleft()
                self._finish_waiter(waiter, error=exc)
                continue
            if result is None:
                self._missed = (waiter, free)
                return
            self._room_waiters.popleft()
            self._finish_waiter(waiter, result=result)
        self._missed = None

    def _finish_waiter(self, waiter: _RoomWaiter, result: Any = None, error: BaseException | None = None) -> None:
        self._room_slots.release()
        if not waiter.future.set_running_or_notify_cancel():
            return  # the caller left meanwhile (it aborts whatever fn did)
        if error is not None:
            waiter.future.set_exception(error)
        else:
            waiter.future.set_result(result)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # One hand-over per event loop and step, not one per request: each call_soon_threadsafe
        # writes to the loop's wake-up pipe from this thread and may wake the loop's thread,
        # which then takes a core from the step's parallel work (64 a step at batch 64).
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                deliveries.setdefault(stream.loop, []).append((stream.outputs, output))
            if output.finished:
                self._handoffs.see(output)
        for loop, items in deliveries.items():
            loop.call_soon_threadsafe(_put_each, items)

    def _fail_streams_now(self, error: str) -> None:
        """From the shard watchdog's thread: a shard died while this thread may be inside a step it
        cannot leave until distributed_timeout_s. The streams end and the health check fails now;
        the rest (hand-off watches, commands, waiters: this thread's alone) when the step returns."""
        self.error = self.error or error
        for request_id, stream in list(self._streams.items()):
            completion = CompletionOutput(0, "", [], finish_reason="error")
            failed = RequestOutput(request_id, None, [], [completion], finished=True, error=error)
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, failed)

    def _fail_all(self, error: str) -> None:
        self._fail_streams_now(error)
        self._handoffs.fail_all(error)
        while self._room_waiters:
            self._finish_waiter(self._room_waiters.popleft(), error=EngineStopped(f"the engine stopped: {error}"))
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped(f"the engine stopped: {error}"))


def _put_each(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for outputs, output in items:
        outputs.put_nowait(output)


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
        "prefix_cache_queried_tokens": stats.kv.num_queried_tokens,
        "prefix_cache_hit_tokens": stats.kv.num_hit_tokens,
        "num_preemptions": stats.num_preemptions,
        "num_handoff": stats.num_handoff,
        "num_kv_lease_expirations": engine.num_kv_lease_expirations,
        "num_prefills_expired": engine.num_prefills_expired,
        "num_kv_pushes_cancelled": engine.num_kv_pushes_cancelled,
        "num_kv_transfer_failures": engine.num_kv_transfer_failures,
        "num_steps": engine.num_steps,
        "num_steps_ahead": engine.num_steps_ahead,
        "num_prefill_tokens_queued": engine.scheduler.num_prefill_tokens_queued(),
        "prefill_tokens_per_s": engine.prefill_tokens_per_s,
        **engine.grammars.report(),
    }
