"""Each role's side of the KV hand-off (engine.handoff) over shard reports, TP=2, no shards: what
each hook asks of the engine."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequestError
from common.kv_messages import ConnectorStep, PushReport, PushWindow, ReceiveReport, ShardReport, TransferState
from common.serving import KV_LOAD_FAILED
from engine.handoff import BlockFate, DecodeHandoff, Ending, NullHandoff, PrefillHandoff
from engine.handoff.prefill import LEASE_EXPIRED, PREEMPTED
from engine.request import RequestStatus
from engine.scheduler import ScheduledChunk, SchedulerOutput

_TRANSFERRING, _FAILED, _DONE = TransferState.TRANSFERRING, TransferState.FAILED, TransferState.DONE
_ERROR = RequestStatus.FINISHED_ERROR


def _first_chunk(handoff: PrefillHandoff, request_id: str = "r") -> ConnectorStep:
    """A 40-token prompt's first chunk of 24 tokens (one full block of 16) under a fresh ticket."""
    handoff.check_ticket(request_id, {"request_id": request_id, "lease_s": 1e6})
    handoff.accept_ticket(request_id, {"request_id": request_id, "lease_s": 1e6})
    chunk = ScheduledChunk(request_id, list(range(24)), 0, [7, 8, 9], samples=False, in_prompt=True)
    actions, orders = handoff.after_schedule(SchedulerOutput([chunk]))
    assert actions.end == [] and orders is not None
    return orders


def _pushes(*pushes: PushReport) -> list[ShardReport]:
    return [ShardReport(pushes={"r": push}) for push in pushes]


def _receives(*receives: ReceiveReport) -> list[ShardReport]:
    return [ShardReport(receives={"r": receive}) for receive in receives]


def _idle_orders(handoff) -> ConnectorStep:
    return handoff.after_schedule(SchedulerOutput())[1]


def test_one_shard_s_push_failing_mid_prompt_cancels_every_shard_s_and_ends_once():
    handoff = PrefillHandoff(num_shards=2, block_size=16)
    (push,) = _first_chunk(handoff).pushes
    assert push.block_ids == [7] and not push.last and push.ticket is not None and handoff.pushing == {"r": 1}
    refused = PushReport(_FAILED, "TransferRefused: released")
    actions = handoff.after_step(_pushes(refused, PushReport(_TRANSFERRING)))
    error = "KV transfer failed: TransferRefused: released"
    assert actions.end == [Ending("r", _ERROR, error, hold_blocks=True)] and actions.release == []
    assert "r" not in handoff.pushing and handoff.poll().cancel == ["r"]
    # Reported again (still failed on one shard, still sending on the other): not ended twice.
    actions = handoff.after_step(_pushes(refused, PushReport(_TRANSFERRING)))
    assert actions.end == [] and actions.release == [] and handoff.busy
    actions = handoff.after_step(_pushes(refused, PushReport(_FAILED, "cancelled", 0.1, 0, 1)))
    assert actions.release == ["r"] and handoff.sending == set() and handoff.poll() is None
    assert handoff.ended == {} and handoff.counts.num_kv_transfer_failures == 1  # counted once, not as a hand-off
    assert _idle_orders(handoff).forget == ["r"] and not handoff.busy


def test_a_push_that_ends_with_its_prompt_is_not_cancelled():
    handoff = PrefillHandoff(num_shards=2, block_size=16)
    _first_chunk(handoff)
    last = ScheduledChunk("r", list(range(24, 40)), 24, [7, 8, 9], samples=True, in_prompt=True)
    actions, orders = handoff.after_schedule(SchedulerOutput([last]))
    assert orders.pushes == [PushWindow("r", [8, 9], None, last=True)] and handoff.pushing == {}
    assert handoff.holds_id("r")  # its id is the shards' key until the push ends
    # A failure reported after the prompt's end is the hand-off's, not a mid-prompt one.
    actions = handoff.after_step(_pushes(*[PushReport(_FAILED, "lease expired", 0.1, 10, 2)] * 2))
    assert actions.end == [] and actions.release == ["r"]
    sent = handoff.ended["r"]
    assert not sent.cancelled and sent.failure == "lease expired" and sent.num_windows == 2 and sent.num_bytes == 20
    assert handoff.counts.num_kv_transfer_failures == 1 and not handoff.holds_id("r")


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
    from engine.handoff import prefill

    clock = [1000.0]
    monkeypatch.setattr(prefill.time, "monotonic", lambda: clock[0])
    handoff = PrefillHandoff(num_shards=1, block_size=16)
    handoff.accept_ticket("r", {"request_id": "r", "lease_s": 5.0})
    handoff.accept_ticket("q", {"request_id": "q", "lease_s": 1.0})
    clock[0] += 3.0  # both queued 3 s behind other prompts
    assert handoff.before_schedule(clock[0]).abort == [("q", LEASE_EXPIRED)]
    assert handoff.on_abort("q").blocks is BlockFate.FREE and "q" not in handoff.tickets  # nothing was sent
    chunk = ScheduledChunk("r", list(range(24)), 0, [7, 8, 9], samples=False, in_prompt=True)
    (push,) = handoff.after_schedule(SchedulerOutput([chunk]))[1].pushes
    assert push.ticket["lease_s"] == 2.0 and handoff.push_leases == {"r": 1005.0}
    assert handoff.before_schedule(1004.9).abort == []
    assert handoff.before_schedule(1005.0).abort == [("r", LEASE_EXPIRED)]
    # The abort that follows cuts the push off: its blocks are held until the shards let go.
    plan = handoff.on_abort("r")
    assert plan.blocks is BlockFate.HOLD and plan.orders.cancel == ["r"]
    assert handoff.counts.num_prefills_expired == 2 and handoff.counts.num_kv_pushes_cancelled == 1


def test_a_push_preempted_mid_prompt_ends_and_is_cancelled_in_the_same_step_s_orders():
    handoff = PrefillHandoff(num_shards=2, block_size=16)
    _first_chunk(handoff)
    actions, orders = handoff.after_schedule(SchedulerOutput(preempted_request_ids=["r", "other"]))
    # Its blocks are free already (preempted): it ends without holding any.
    assert actions.end == [Ending("r", _ERROR, PREEMPTED, hold_blocks=False)] and orders.cancel == ["r"]
    assert handoff.counts.num_kv_pushes_cancelled == 1


def test_a_failed_step_cuts_off_its_pushes_before_it_ends_and_aborts_the_rest():
    handoff = PrefillHandoff(num_shards=2, block_size=16)
    _first_chunk(handoff)
    orders, actions = handoff.after_failed_step(["r", "s"], "out of memory")
    assert orders.cancel == ["r"] and actions.end == [Ending("r", _ERROR, "out of memory", hold_blocks=True)]
    assert actions.abort == [("s", "out of memory")]
    # Nothing under way: nothing for the shards, every request aborted.
    assert PrefillHandoff(2, 16).after_failed_step(["s"], "oom") == (None, type(actions)(abort=[("s", "oom")]))


def test_an_aborted_prompt_whose_push_is_done_waits_for_its_transfer():
    handoff = PrefillHandoff(num_shards=1, block_size=None)  # the whole prompt with its last chunk
    handoff.accept_ticket("r", {"request_id": "r"})
    last = ScheduledChunk("r", list(range(40)), 0, [7, 8, 9], samples=True, in_prompt=True)
    (push,) = handoff.after_schedule(SchedulerOutput([last]))[1].pushes
    assert push.last and push.block_ids == [7, 8, 9]
    assert handoff.on_abort("r").blocks is BlockFate.ON_THE_WIRE


def test_decode_lands_kv_when_every_shard_has_it_with_prefill_s_first_token():
    handoff = DecodeHandoff(num_shards=2)
    with pytest.raises(InvalidRequestError, match="kv_ticket"):
        handoff.expect("r", {"request_id": "someone else"})
    assert handoff.expect("r", {"request_id": "r"}).expects == [{"request_id": "r"}] and handoff.busy
    assert handoff.after_step(_receives(ReceiveReport(_DONE, None, 42))).landed == []  # one shard of two
    actions = handoff.after_step(_receives(ReceiveReport(_DONE, None, 42), ReceiveReport(_DONE)))
    assert actions.landed == [("r", 42)] and actions.abort == [] and actions.forget_now == []
    assert _idle_orders(handoff).forget == ["r"] and not handoff.busy


@pytest.mark.parametrize(
    ("reports", "reason"),
    [
        ([ReceiveReport(_FAILED, "lease expired"), ReceiveReport(_TRANSFERRING)], "KV transfer failed: lease expired"),
        ([ReceiveReport(_DONE), ReceiveReport(_DONE)], "KV transfer failed: the prefill side sent no first token"),
    ],
)
def test_decode_fails_a_receive_once_every_shard_stops_writing_its_blocks(reports, reason):
    handoff = DecodeHandoff(num_shards=2)
    handoff.expect("r", {"request_id": "r"})
    actions = handoff.after_step(_receives(*reports))
    assert actions.landed == [] and actions.forget_now == ["r"]
    assert actions.abort == [("r", f"{KV_LOAD_FAILED}: {reason}")]
    assert handoff.counts.num_kv_transfer_failures == 1
    assert handoff.counts.num_kv_lease_expirations == ("lease expired" in reason)


def test_decode_aborting_a_receive_stops_the_shards_before_its_blocks_are_freed():
    handoff = DecodeHandoff(num_shards=2)
    handoff.expect("r", {"request_id": "r"})
    plan = handoff.on_abort("r")
    assert plan.blocks is BlockFate.FREE and plan.orders == ConnectorStep(forget=["r"])
    assert handoff.on_abort("r").orders is None and not handoff.busy  # once


@pytest.mark.parametrize("handoff", [NullHandoff(), DecodeHandoff(1)], ids=["colocated", "decode"])
def test_only_a_prefill_hand_off_takes_tickets(handoff):
    with pytest.raises(InvalidRequestError, match="kv_ticket needs a prefill-role engine") as refused:
        handoff.check_ticket("r", {"request_id": "r"})
    assert refused.value.param == "kv_ticket"
    with pytest.raises(InvalidRequestError, match="is not a ticket for request 'r'"):
        PrefillHandoff(1).check_ticket("r", {"request_id": "q"})
    assert handoff.after_failed_step(["a"], "oom")[1].abort == [("a", "oom")]
