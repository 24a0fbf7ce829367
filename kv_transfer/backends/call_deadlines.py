"""Deadlines a server imposes on its calls, whatever the caller asked: one thread cancels every
call past its own.

A gRPC server thread serves one call to its end, and a call that sends nothing holds its thread
for as long as its client keeps the stream open (forever, without a client deadline): a few
silent streams would pin every thread. Each call is watched from its start; its deadline moves
once the call proved itself (an authentic header), and is dropped when it ends.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class CallDeadlines:
    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._calls: dict[int, tuple[float, Callable[[], object]]] = {}  # key -> (deadline, cancel)
        self._heap: list[tuple[float, int]] = []
        self._keys = itertools.count()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.num_cancelled = 0

    def watch(self, deadline: float, cancel: Callable[[], object]) -> int:
        """Call ``cancel`` once ``deadline`` (time.monotonic) passes, unless moved or ended first."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._name}-deadlines", daemon=True)
                self._thread.start()
            key = next(self._keys)
            self._calls[key] = (deadline, cancel)
            heapq.heappush(self._heap, (deadline, key))
            self._cond.notify()
            return key

    def move(self, key: int, deadline: float) -> None:
        with self._cond:
            if key in self._calls:
                self._calls[key] = (deadline, self._calls[key][1])
                heapq.heappush(self._heap, (deadline, key))
                self._cond.notify()

    def end(self, key: int) -> None:
        with self._cond:
            self._calls.pop(key, None)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                due: list[Callable[[], object]] = []
                while self._heap and self._heap[0][0] <= now:
                    deadline, key = heapq.heappop(self._heap)
                    call = self._calls.get(key)
                    if call is not None and call[0] == deadline:  # else moved (a later entry) or ended
                        del self._calls[key]
                        due.append(call[1])
                if due:
                    self._cond.release()
                    try:
                        for cancel in due:
                            self.num_cancelled += 1
                            try:
                                cancel()
                            except Exception:
                                logger.exception("%s: cancelling a call past its deadline failed", self._name)
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait(self._heap[0][0] - now if self._heap else None)
