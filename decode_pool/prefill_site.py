"""Conditional disaggregation: does a decode replica compute a prompt itself, or have the prefill pool do it?

The router sends each request's estimate of the remote path (``RemotePrefillEstimate``: the best
prefill replica's queue, its prefix-cache hit for the prompt, its measured rate, and the measured
overhead of a hand-off). The decode replica adds what only it knows — its own prefix-cache hit
(in multi-turn chat it holds the last answer too, which no prefill replica has), its own queue
and rate, and how many requests its decode batch is running — and ``choose_prefill_site`` decides:

    local time  = (prompt tokens queued here + the prompt's tokens not cached here) / local rate
    remote time = RemotePrefillEstimate.seconds(prompt)
    stall       = local time                                          (the running batch waits that long)

    local  iff  local time <= remote time  and  (nothing is running  or  stall <= max_stall_s)
                (a tie goes local only when nothing is running: no one is held up to save the hand-off)

So short prompts, large local hits and long prefill queues go local; long prompts stay remote,
where they do not hold up the tokens of every running request. Pure, for tests and replays.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.serving import RemotePrefillEstimate


@dataclass(frozen=True)
class LocalState:
    """The decode replica's side, read on its engine thread."""

    num_cached_tokens: int  # of this prompt, in this replica's prefix cache
    num_queued_tokens: int  # prompt tokens this replica still has to compute (preempted, other local prefills)
    tokens_per_s: float  # this replica's measured prefill rate; 0: not measured yet
    num_running: int  # requests in its decode batch


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
    """Where the prompt's first token comes soonest without stalling the running batch past
    ``max_stall_s`` (see the module docstring). A replica that has not prefilled yet is assumed
    as fast as the remote one: same model, and each replica owns the same kind of device."""
    rate = local.tokens_per_s if local.tokens_per_s > 0 else remote.tokens_per_s
    uncached = max(1, num_prompt_tokens - local.num_cached_tokens)
    # The running batch waits for the prompts queued here before this one too: a burst of short
    # prompts each within the bound must not stall it by their sum.
    local_s = stall_s = (local.num_queued_tokens + uncached) / rate
    remote_s = remote.seconds(num_prompt_tokens)
    facts = (
        f"{local.num_cached_tokens} of {num_prompt_tokens} prompt tokens cached here, "
        f"{local.num_queued_tokens} queued; est. {local_s * 1e3:.0f} ms here vs {remote_s * 1e3:.0f} ms on "
        f"prefill replica {remote.replica_id} ({remote.num_cached_tokens} cached, {remote.num_queued_tokens} queued, "
        f"{remote.overhead_s * 1e3:.0f} ms hand-off)"
    )
    if local_s > remote_s or (local.num_running and local_s == remote_s):
        return PrefillSite(False, f"remote: faster there; {facts}", local_s, remote_s)
    if local.num_running and stall_s > max_stall_s:
        why = f"would stall {local.num_running} running requests {stall_s * 1e3:.0f} ms > {max_stall_s * 1e3:.0f} ms"
        return PrefillSite(False, f"remote: {why}; {facts}", local_s, remote_s)
    return PrefillSite(True, f"local: {facts}", local_s, remote_s)
