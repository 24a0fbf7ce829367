"""The driver's hand-off bookkeeping over shard reports (engine.kv_handoff), TP=2, no shards."""

from __future__ import annotations

from common.kv_messages import ConnectorStep, PushReport, PushWindow, ReceiveReport, ShardReport, TransferState
from engine.kv_handoff import KVHandoff
from engine.scheduler import ScheduledChunk, SchedulerOutput

_TRANSFERRING, _FAILED = TransferState.TRANSFERRING, TransferState.FAILED


def _first_chunk(handoff: KVHandoff) -> ConnectorStep:
    """A 40-token prompt's first chunk of 24 tokens (one full block of 16) under a fresh ticket."""
    handoff.send_on_prefill("r", {"request_id": "r", "lease_s": 1e6})
    chunk = ScheduledChunk("r", list(range(24)), 0, [7, 8, 9], samples=False, in_prompt=True)
    return handoff.connector_step(SchedulerOutput([chunk]))


def _reports(*pushes: PushReport) -> list[ShardReport]:
    return [ShardReport(pushes={"r": push}) for push in pushes]


def test_one_shard_s_push_failing_mid_prompt_cancels_every_shard_s_and_ends_once():
    handoff = KVHandoff(num_shards=2, block_size=16)
    (push,) = _first_chunk(handoff).pushes
    assert push.block_ids == [7] and not push.last and push.ticket is not None and handoff.pushing == {"r": 1}
    refused = PushReport(_FAILED, "TransferRefused: released")
    result = handoff.merge(_reports(refused, PushReport(_TRANSFERRING)))
    assert result.failed_pushes == [("r", "TransferRefused: released")] and result.sent == []
    assert "r" not in handoff.pushing and handoff.connector_step(None).cancel == ["r"]
    # Reported again (still failed on one shard, still sending on the other): not ended twice.
    result = handoff.merge(_reports(refused, PushReport(_TRANSFERRING)))
    assert result.failed_pushes == [] and result.sent == [] and handoff.busy
    result = handoff.merge(_reports(refused, PushReport(_FAILED, "cancelled", 0.1, 0, 1)))
    (sent,) = result.sent
    assert sent.cancelled and sent.failure == "TransferRefused: released" and handoff.sending == set()
    assert handoff.connector_step(None).forget == ["r"] and not handoff.busy


def test_a_push_that_ends_with_its_prompt_is_not_cancelled():
    handoff = KVHandoff(num_shards=2, block_size=16)
    _first_chunk(handoff)
    last = ScheduledChunk("r", list(range(24, 40)), 24, [7, 8, 9], samples=True, in_prompt=True)
    (push,) = handoff.connector_step(SchedulerOutput([last])).pushes
    assert push == PushWindow("r", [8, 9], None, last=True) and handoff.pushing == {}
    # A failure reported after the prompt's end is the hand-off's, not a mid-prompt one.
    result = handoff.merge(_reports(*[PushReport(_FAILED, "lease expired", 0.1, 10, 2)] * 2))
    (sent,) = result.sent
    assert result.failed_pushes == [] and not sent.cancelled and sent.failure == "lease expired"
    assert sent.num_windows == 2 and sent.num_bytes == 20


def test_messages_cross_the_process_edge_unchanged():
    import msgpack

    step = ConnectorStep(
        pushes=[PushWindow("a", [1, 2], {"request_id": "a", "secret": "s"}, last=False), PushWindow("b", [3])],
        expects=[{"request_id": "c"}],
        forget=["d"],
        cancel=["e"],
    )
    assert ConnectorStep.from_wire(msgpack.unpackb(msgpack.packb(step.to_wire()), raw=False)) == step
    report = ShardReport(
        pushes={"a": PushReport(TransferState.DONE, None, 0.5, 100, 2), "b": PushReport(_TRANSFERRING)},
        receives={"c": ReceiveReport(TransferState.DONE, None, 42)},
    )
    back = ShardReport.from_wire(msgpack.unpackb(msgpack.packb(report.to_wire()), raw=False))
    assert back == report and back.pushes["a"].state is TransferState.DONE


def test_a_ticket_s_lease_counts_from_its_arrival_and_the_push_gets_what_is_left(monkeypatch):
    import time

    from engine import kv_handoff

    clock = [1000.0]
    monkeypatch.setattr(kv_handoff.time, "monotonic", lambda: clock[0])
    handoff = KVHandoff(num_shards=1, block_size=16)
    handoff.send_on_prefill("r", {"request_id": "r", "lease_s": 5.0})
    handoff.send_on_prefill("q", {"request_id": "q", "lease_s": 1.0})
    clock[0] += 3.0  # both queued 3 s behind other prompts
    assert handoff.expired(clock[0]) == ["q"]
    handoff.drop("q")
    chunk = ScheduledChunk("r", list(range(24)), 0, [7, 8, 9], samples=False, in_prompt=True)
    (push,) = handoff.connector_step(SchedulerOutput([chunk])).pushes
    assert push.ticket["lease_s"] == 2.0 and handoff.push_leases == {"r": 1005.0}
    assert handoff.expired(1005.0) == ["r"] and time.monotonic is not None
