"""Killing a process mid-transfer on the shared-memory backend: both sides end in a terminal state
with the reason, within the lease, and never hang. (gRPC and torch.distributed have their own.)"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from kv_transfer import KVReceiver, KVSender, KVTicket, TransferState, make_ticket
from kv_transfer.transport import get_transport
from tests.kv_transfer.harness import a_killed_receiver_fails_the_sender, make_side, wait_terminal

BACKEND = "shm"


def _receiver_process(backend: str, out: mp.Queue, tickets: mp.Queue) -> None:
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], backend)
    transport = get_transport(backend)
    out.put(transport.serve(receiver))
    receiver.expect(KVTicket.from_dict(tickets.get(timeout=30)))
    out.put("expected")  # the ticket is registered: chunks under it are accepted from now on
    time.sleep(60)  # killed by the test long before


def _sender_process(backend: str, ticket: dict, done_layers: mp.Queue, shared: bool) -> None:
    src, _ = make_side(1, fill=True, shared=shared)
    sender = KVSender(src.layouts[0], "m", get_transport(backend))
    parsed = KVTicket.from_dict(ticket)
    sender.start(parsed, [1, 2, 3, 4])
    sender.send_layer(parsed.request_id, 0, src.caches[0][0])
    while sender.poll(parsed.request_id).layers_sent < 1:
        time.sleep(0.01)
    done_layers.put(1)
    time.sleep(60)  # killed before sending the other layers


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["staged", "pulled"])
def test_receiver_killed_mid_transfer_fails_the_sender_within_the_lease(shared):
    ctx = mp.get_context("spawn")
    endpoints, tickets = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver_process, args=(BACKEND, endpoints, tickets), daemon=True)
    proc.start()
    try:
        endpoint = endpoints.get(timeout=60)
        dst, _ = make_side(1, fill=False)
        ticket = make_ticket("req-1", BACKEND, [endpoint], dst.layouts[0], "m", [1, 2, 3, 4], 13, lease_s=20)
        tickets.put(ticket.to_dict())
        assert endpoints.get(timeout=30) == "expected"
        transport = get_transport(BACKEND)
        kill = lambda: (proc.kill(), proc.join(10))  # noqa: E731
        _, seconds = a_killed_receiver_fails_the_sender(transport, ticket, kill, [1, 2, 3, 4], 1, shared=shared)
        assert seconds < 20
        transport.shutdown()
    finally:
        proc.kill()


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["staged", "pulled"])
def test_sender_killed_mid_transfer_fails_the_receiver_at_lease_expiry(shared):
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], BACKEND)
    transport = get_transport(BACKEND)
    endpoint = transport.serve(receiver)
    ticket = make_ticket("req-1", BACKEND, [endpoint], dst.layouts[0], "m", [1, 2, 3, 4], 13, lease_s=4)
    receiver.expect(ticket)
    ctx = mp.get_context("spawn")
    progress = ctx.Queue()
    proc = ctx.Process(target=_sender_process, args=(BACKEND, ticket.to_dict(), progress, shared), daemon=True)
    proc.start()
    try:
        progress.get(timeout=60)
        assert receiver.poll("req-1").state is TransferState.TRANSFERRING
        proc.kill()
        proc.join(10)
        (status,) = wait_terminal([lambda: receiver.poll("req-1")], timeout_s=15)
        assert status.state is TransferState.FAILED and "lease" in status.reason
    finally:
        proc.kill()
        transport.shutdown()
