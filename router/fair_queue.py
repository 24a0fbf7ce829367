"""One worker thread that serves its callers' jobs tenant by tenant, in turn.

The router tokenizes on one thread (a fast tokenizer's encode borrows its state mutably, so two at
once would not be faster, and a thread per request would let one client's long prompts take every
core). Served first come, first served, a tenant that sends many long prompts puts every other
tenant behind all of them. Here each tenant has its own FIFO, and the worker takes one job from
each tenant with work in turn (round robin): another tenant's job waits for at most one job of
each tenant ahead of it in the turn, however many they queued.

Jobs are ``concurrent.futures.Future``s: one cancelled before it starts never runs (the router
cancels the job of a client that left); one running is not interrupted.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class FairQueue:
    def __init__(self, thread_name: str) -> None:
        self._queues: dict[str, deque[tuple[Future, Callable[..., Any], tuple]]] = {}
        self._turn: deque[str] = deque()  # tenants with queued jobs, in the order they are served
        self._ready = threading.Condition()
        self._stopped = False
        self.num_run = 0
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._ready:
            if self._stopped:
                raise RuntimeError("the queue is shut down")
            queue = self._queues.setdefault(tenant, deque())
            if not queue:
                self._turn.append(tenant)
            queue.append((future, fn, args))
            self._ready.notify()
        return future

    def queued(self, tenant: str) -> int:
        with self._ready:
            return len(self._queues.get(tenant, ()))

    def shutdown(self) -> None:
        """Cancel what has not started; the running job ends on its own."""
        with self._ready:
            self._stopped = True
            for queue in self._queues.values():
                for future, _, _ in queue:
                    future.cancel()
            self._queues.clear()
            self._turn.clear()
            self._ready.notify()

    def _next(self) -> tuple[Future, Callable[..., Any], tuple] | None:
        with self._ready:
            while not self._turn and not self._stopped:
                self._ready.wait()
            if self._stopped:
                return None
            tenant = self._turn.popleft()
            queue = self._queues[tenant]
            job = queue.popleft()
            if queue:
                self._turn.append(tenant)  # its next job, after every other tenant's
            else:
                del self._queues[tenant]
            return job

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                result = fn(*args)
            except BaseException as exc:  # the caller's to see, as an executor's future carries it
                future.set_exception(exc)
            else:
                future.set_result(result)
            self.num_run += 1
