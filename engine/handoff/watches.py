"""A prefill replica's callers, waiting until their requests' KV hand-offs have ended.

The prefill pool's caller learns a request's end only once its KV is acknowledged by every
receiver (or has failed), not at its prefilled output: it then tells the router the hand-off's
figures, and the source blocks are free. ``AsyncEngine`` holds one ``HandoffWatches`` and calls it
on its engine thread, which alone touches it, after every step.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from common.outputs import RequestOutput
from engine.handoff.hooks import Handoff, SentKV
from engine.scheduler import Scheduler

# After a prefill step that finished prompts, how long the thread may wait for their hand-offs'
# acknowledgements before the next step: this share of the step just run, and never longer than
# the cap (see wait_for_acknowledgements).
_ACK_WAIT_SHARE = 0.1
_MAX_ACK_WAIT_S = 0.05


@dataclass(frozen=True, slots=True)
class HandoffEnded:
    """What a prefill-role request's caller learns once its KV hand-off has ended."""

    output: RequestOutput | None  # the prefilled output; None when the engine failed
    failure: str | None
    sent: SentKV | None = None  # the transfer's figures, when it started
    ended_at: float | None = None  # time.monotonic() on the engine thread when the end was seen


@dataclass(slots=True)
class HandoffWatch:
    """A prefill-role request whose caller waits until its KV hand-off has ended."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    output: RequestOutput | None = None  # the finished (prefilled) output, once seen


class WatchedEngine(Protocol):
    """What the watches read of the engine."""

    handoff: Handoff
    scheduler: Scheduler

    def poll_handoffs(self) -> None: ...


class HandoffWatches:
    def __init__(self, idle_poll_s: float) -> None:
        self._watches: dict[str, HandoffWatch] = {}
        self._idle_poll_s = idle_poll_s

    def __len__(self) -> int:
        return len(self._watches)

    def watch(self, request_id: str, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """A future resolved with a HandoffEnded once the request's KV hand-off ends."""
        watch = HandoffWatch(loop, loop.create_future())
        self._watches[request_id] = watch
        return watch.future

    def drop(self, request_id: str) -> None:
        """Its caller left (aborted): nobody waits for it."""
        self._watches.pop(request_id, None)

    def see(self, output: RequestOutput) -> None:
        """A finished output: a watched request's hand-off ends after it, not before."""
        watch = self._watches.get(output.request_id)
        if watch is not None:
            watch.output = output

    def settle(self, engine: WatchedEngine) -> None:
        """Resolve the watches whose request's hand-off has ended (its source blocks released)."""
        ended = engine.handoff.ended
        for request_id in [r for r in ended if r not in self._watches]:
            del ended[request_id]  # nobody waits for it (aborted): only logged
        for request_id, watch in list(self._watches.items()):
            if watch.output is None or request_id in engine.scheduler.handoff:
                continue  # not prefilled yet, or still sending
            sent = ended.pop(request_id, None)
            failure = watch.output.error or (sent.failure if sent is not None else None)
            del self._watches[request_id]
            _resolve(watch.loop, watch.future, HandoffEnded(watch.output, failure, sent, time.monotonic()))

    def wait_for_acknowledgements(self, engine: WatchedEngine, step_s: float) -> None:
        """Before another step's forward pass, give the hand-offs this step just finished a moment
        to be acknowledged. Without it an acknowledgement is seen only after that next step, whose
        seconds the router's last token then waits out for prefill's reply (a request's cached
        tokens), and its source blocks stay held as long. Bounded by a share of the step just run,
        so at most that share of prefill throughput goes to waiting; usually the receivers answer
        within a millisecond or two and the wait ends at once."""
        if not self._watches or not (engine.scheduler.waiting or engine.scheduler.running):
            return  # nothing watched, or no step to wait behind (the idle loop polls anyway)
        deadline = time.monotonic() + min(_MAX_ACK_WAIT_S, _ACK_WAIT_SHARE * step_s)
        while any(watch.output is not None for watch in self._watches.values()):
            engine.poll_handoffs()
            self.settle(engine)
            if time.monotonic() >= deadline:
                return
            time.sleep(self._idle_poll_s)

    def fail_all(self, error: str) -> None:
        for watch in self._watches.values():
            _resolve(watch.loop, watch.future, HandoffEnded(None, error))
        self._watches.clear()


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
    def _set() -> None:
        if not future.done():
            future.set_result(value)

    loop.call_soon_threadsafe(_set)
