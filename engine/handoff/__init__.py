"""Each role's side of the KV hand-off, as the engine's step sees it: the scheduler side of the
KV connector (vLLM keeps it beside its scheduler; SGLang in per-role classes).

``LLMEngine`` calls the hooks at fixed points and carries out what they return; it holds no role
branches, and a hand-off reads none of the engine's state:

    step()           before_schedule(now)        -> aborts (prefill: leases run out)
                     after_schedule(scheduled)   -> endings (prefill: pushes cut off by preemption),
                                                    and the shards' orders riding on the step
                     after_step(shard reports)   -> endings, blocks to release, KV landed, aborts
    abort_request()  on_abort(request id)        -> what becomes of its blocks; orders to send first
    a failed step    after_failed_step(ids)      -> orders to send first, endings, aborts
    add_request()    check_ticket / accept_ticket   (prefill)
    expect_kv()      expect(request id, ticket)  -> orders registering it on every shard (decode)
    poll_handoffs()  poll()                      -> orders for a round without a forward pass

Where to look:
- ``prefill.py``: tickets, push windows, leases, cut-off pushes, what a push's end releases;
- ``decode.py``: expected tickets, KV landed (the first token), failed receives;
- ``hooks.py``: the protocol, what the hooks return, and the null hand-off of a colocated engine;
- ``watches.py``: a prefill replica's callers waiting until their hand-offs have ended.

The messages to and from the shards are common.kv_messages' (a ConnectorStep out, one ShardReport
per shard back): the engine never imports the transfer library.
"""

from __future__ import annotations

from common.config import EngineRole
from engine.handoff.decode import DecodeHandoff
from engine.handoff.hooks import (
    AbortPlan,
    BlockFate,
    Ending,
    Handoff,
    HandoffActions,
    HandoffCounts,
    NullHandoff,
    SentKV,
)
from engine.handoff.prefill import PrefillHandoff

__all__ = [
    "AbortPlan",
    "BlockFate",
    "DecodeHandoff",
    "Ending",
    "Handoff",
    "HandoffActions",
    "HandoffCounts",
    "NullHandoff",
    "PrefillHandoff",
    "SentKV",
    "make_handoff",
]


def make_handoff(role: EngineRole, has_connector: bool, num_shards: int, push_block_size: int | None) -> Handoff:
    """The hand-off of an engine of this role. ``push_block_size``: prefill pushes each prompt
    chunk's completed blocks of this size (None: the whole prompt with its last chunk)."""
    if not has_connector or role is EngineRole.COLOCATED:
        return NullHandoff()
    if role is EngineRole.PREFILL:
        return PrefillHandoff(num_shards, push_block_size)
    return DecodeHandoff(num_shards)
