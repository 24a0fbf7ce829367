"""The choices of one answer: ``n`` samples of each prompt of a batch, each a request of its own on
the pools, their deltas merged into one stream, each tagged with its choice's ``index``.

Choice ``i`` samples prompt ``i // n`` with ``SamplingParams.for_choice(i % n)`` (its own seed
stream). A prompt's first choice starts at once; its other choices start once it has sent its
first delta, when its prompt's blocks sit in the prefix cache of the replica it ran on: the
placement sends them there (router.prefix_index remembers where it routed the prompt) and they
compute only the prompt's last, partial block. A choice that fails before any delta went out fails
the request (the caller answers with a status); the others are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence

from common.serving import StreamDelta

# Deltas waiting for the client, per choice: a slow reader holds the choices' streams back.
_QUEUED_PER_CHOICE = 64

StartChoice = Callable[[int], AsyncIterator[StreamDelta]]


def merged_choices(start: StartChoice, num_prompts: int, n: int) -> AsyncIterator[StreamDelta]:
    """Every choice's deltas as they come, ``index`` set; ends when every choice has finished.
    ``start(i)``: choice i's deltas (the orchestrator's run of its request). One choice's are
    passed on as they are: the common request pays nothing for the others'."""
    if num_prompts * n == 1:
        return start(0)
    return _merged(start, num_prompts, n)


async def _merged(start: StartChoice, num_prompts: int, n: int) -> AsyncIterator[StreamDelta]:
    queue: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue(
        _QUEUED_PER_CHOICE * num_prompts * n
    )
    leaders_started = [asyncio.Event() for _ in range(num_prompts)]
    tasks = [asyncio.ensure_future(_relay(start, i, n, queue, leaders_started)) for i in range(num_prompts * n)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield dataclasses.replace(item, index=index)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _relay(
    start: StartChoice,
    index: int,
    n: int,
    queue: asyncio.Queue,
    leaders_started: Sequence[asyncio.Event],
) -> None:
    prompt_index, is_leader = divmod(index, n)[0], index % n == 0
    leader_started = leaders_started[prompt_index]
    try:
        if not is_leader:
            await leader_started.wait()
        async with contextlib.aclosing(start(index)) as deltas:
            async for delta in deltas:
                leader_started.set()
                await queue.put((index, delta))
        await queue.put((index, None))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the consumer raises it: a refusal before any delta becomes the status
        await queue.put((index, exc))
    finally:
        leader_started.set()  # a leader that failed lets its followers try (they fail or serve alone)
