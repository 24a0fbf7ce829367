"""How late the router's event loop runs: the one number that says whether anything blocks it.

Every stream, every header deadline and every health answer of a router replica waits on one
event loop. Work that holds it (a parse, a tokenization, a lock taken in a thread that keeps the
GIL) shows here first: a sleep of ``interval_s`` that returns later than asked was kept waiting by
whatever held the loop. Each wake's lateness is observed (the router exports it as a histogram,
``pdserve:router_event_loop_lag_seconds``), and the worst of the last ``window_s`` is kept for
``/pdserve/status``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable


class LoopLagProbe:
    def __init__(self, observe: Callable[[float], None], interval_s: float = 0.05, window_s: float = 60.0) -> None:
        self.observe = observe
        self.interval_s = interval_s
        self.window_s = window_s
        self._recent: deque[tuple[float, float]] = deque()  # (when, lag), lags only above 1 ms
        self.num_wakes = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.record(max(0.0, loop.time() - asked))

    def record(self, lag_s: float) -> None:
        self.num_wakes += 1
        self.observe(lag_s)
        now = time.monotonic()
        if lag_s > 0.001:
            self._recent.append((now, lag_s))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def worst_recent_s(self) -> float:
        """The largest lateness of the last ``window_s`` seconds (0 when none passed 1 ms)."""
        cutoff = time.monotonic() - self.window_s
        return max((lag for when, lag in self._recent if when >= cutoff), default=0.0)
