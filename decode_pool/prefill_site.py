"""Conditional disaggregation: does a decode replica compute a prompt itself, or have the prefill pool do it?

The router sends each request's estimate of the remote path (``RemotePrefillEstimate``: the best
prefill replica's queue, its prefix-cache hit for the prompt, its measured rate, and the measured
overhead of a hand-off). The decode replica adds what only it knows — its own prefix-cache hit
(in multi-turn chat it holds the last answer too, which no prefill replica has), its own queue
and rate, whether its decode batch is running and how long its steps take — and
``choose_prefill_site`` decides.

Beside a running batch the replica computes a prompt in chunks (``SchedulerConfig.max_decode_stall_s``):
each step spends at most ``max_stall_s`` on prompt tokens (``chunk`` of them at the local rate, at
least MIN_STALL_CHUNK_TOKENS), so the batch's tokens come a little later each step instead of
waiting for the whole prompt, and the prompt takes one decode step longer per chunk:

    to compute  = prompt tokens queued here + the prompt's tokens not cached here
    local time  = to compute / local rate                       (nothing running)
                = to compute / local rate + ceil(to compute / chunk) x decode step   (a batch running)
    remote time = RemotePrefillEstimate.seconds(prompt)

    local  iff  local time <= remote time
                (a tie goes local only when nothing is running: no one is held up to save the hand-off)

So short prompts, large local hits and a prefill pool with a queue go local; while the prefill
pool keeps up, prompts go there, where they do not slow the running batch at all. The decode
cores then take prompts only when that brings first tokens sooner. Pure, for tests and replays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.config import MIN_STALL_CHUNK_TOKENS
from common.serving import RemotePrefillEstimate


@dataclass(frozen=True)
class LocalState:
    """The decode replica's side, read on its engine thread."""

    num_cached_tokens: int  # of this prompt, in this replica's prefix cache
    num_queued_tokens: int  # prompt tokens this replica still has to compute (preempted, other local prefills)
    tokens_per_s: float  # this replica's measured prefill rate; 0: not measured yet
    num_running: int  # requests in its decode batch (decode role: KV received ones included)
    decode_step_s: float = 0.0  # its measured step time with no prompt tokens; 0: not measured yet
    chunk_tokens: int = 0  # the prompt tokens its steps beside decodes take (the engine's cap); 0: from the rate


@dataclass(frozen=True)
class PrefillSite:
    local: bool
    reason: str  # for the request's trace span
    local_s: float
    remote_s: float

    @property
    def name(self) -> str:
        return "local" if self.local else "remote"


def choose_prefill_site(
    num_prompt_tokens: int, remote: RemotePrefillEstimate, local: LocalState, max_stall_s: float
) -> PrefillSite:
    """Where the prompt's first token comes soonest (see the module docstring). A replica that has
    not prefilled yet is assumed as fast as the remote one: same model, and each replica owns the
    same kind of device. ``max_stall_s``: the engine's max_decode_stall_s."""
    rate = local.tokens_per_s if local.tokens_per_s > 0 else remote.tokens_per_s
    # The prompts queued here go first: a burst of short prompts is costed by its sum.
    to_compute = local.num_queued_tokens + max(1, num_prompt_tokens - local.num_cached_tokens)
    local_s = to_compute / rate
    chunk = local.chunk_tokens or max(MIN_STALL_CHUNK_TOKENS, int(rate * max_stall_s))
    if local.num_running:
        local_s += math.ceil(to_compute / chunk) * local.decode_step_s
    remote_s = remote.seconds(num_prompt_tokens)
    facts = (
        f"{local.num_cached_tokens} of {num_prompt_tokens} prompt tokens cached here, "
        f"{local.num_queued_tokens} queued, {local.num_running} running in "
        f"{local.decode_step_s * 1e3:.0f} ms steps, chunks of {chunk}; est. {local_s * 1e3:.0f} ms here vs "
        f"{remote_s * 1e3:.0f} ms on prefill replica {remote.replica_id} ({remote.num_cached_tokens} cached, "
        f"{remote.num_queued_tokens} queued, {remote.overhead_s * 1e3:.0f} ms hand-off)"
    )
    if local_s > remote_s or (local.num_running and local_s == remote_s):
        return PrefillSite(False, f"remote: faster there; {facts}", local_s, remote_s)
    return PrefillSite(True, f"local: {facts}", local_s, remote_s)
