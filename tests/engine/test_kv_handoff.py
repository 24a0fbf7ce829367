"""The driver's hand-off bookkeeping over shard reports (engine.kv_handoff), TP=2, no shards."""

from __future__ import annotations

from engine.kv_handoff import KVHandoff
from engine.scheduler import ScheduledChunk, SchedulerOutput
from kv_transfer import TransferState

_TRANSFERRING, _DONE, _FAILED = (int(s) for s in (TransferState.TRANSFERRING, TransferState.DONE, TransferState.FAILED))


def _first_chunk(handoff: KVHandoff) -> dict:
    """A 40-token prompt's first chunk of 24 tokens (one full block of 16) under a fresh ticket."""
    handoff.send_on_prefill("r", {"request_id": "r", "lease_deadline": 1e12})
    chunk = ScheduledChunk("r", list(range(24)), 0, [7, 8, 9], samples=False, in_prompt=True)
    return handoff.meta_for(SchedulerOutput([chunk]))


def test_one_shard_s_push_failing_mid_prompt_cancels_every_shard_s_and_ends_once():
    handoff = KVHandoff(num_shards=2, block_size=16)
    (send,) = _first_chunk(handoff)["sends"]
    assert send["block_ids"] == [7] and not send["last"] and handoff.pushing == {"r": 1}
    refused = [_FAILED, "TransferRefused: released", None, 0, 1]
    result = handoff.merge([{"sends": {"r": refused}}, {"sends": {"r": [_TRANSFERRING, None, None, 0, 1]}}])
    assert result.failed_pushes == [("r", "TransferRefused: released")] and result.sent == []
    assert "r" not in handoff.pushing and handoff.meta_for(None)["cancel"] == ["r"]
    # Reported again (still failed on one shard, still sending on the other): not ended twice.
    result = handoff.merge([{"sends": {"r": refused}}, {"sends": {"r": [_TRANSFERRING, None, None, 0, 1]}}])
    assert result.failed_pushes == [] and result.sent == [] and handoff.busy
    result = handoff.merge([{"sends": {"r": refused}}, {"sends": {"r": [_FAILED, "cancelled", 0.1, 0, 1]}}])
    (sent,) = result.sent
    assert sent.cancelled and sent.failure == "TransferRefused: released" and handoff.sending == set()
    assert handoff.meta_for(None)["forget"] == ["r"] and not handoff.busy


def test_a_push_that_ends_with_its_prompt_is_not_cancelled():
    handoff = KVHandoff(num_shards=2, block_size=16)
    _first_chunk(handoff)
    last = ScheduledChunk("r", list(range(24, 40)), 24, [7, 8, 9], samples=True, in_prompt=True)
    (send,) = handoff.meta_for(SchedulerOutput([last]))["sends"]
    assert send == {"block_ids": [8, 9], "last": True, "request_id": "r"} and handoff.pushing == {}
    # A failure reported after the prompt's end is the hand-off's, not a mid-prompt one.
    result = handoff.merge([{"sends": {"r": [_FAILED, "lease expired", 0.1, 10, 2]}}] * 2)
    (sent,) = result.sent
    assert result.failed_pushes == [] and not sent.cancelled and sent.failure == "lease expired"
    assert sent.num_windows == 2 and sent.num_bytes == 20
