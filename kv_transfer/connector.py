"""The engine's KV connector (engine.kv_connector) backed by kv_transfer: one per shard.

A prefill shard pushes each layer of the windows the driver's ConnectorStep names, right after the
layer is computed; a decode shard serves a receiver and registers the tickets it expects. Each
step ends with a ShardReport: every open transfer's state on this shard (common.kv_messages).

A push is one window of a ticket's blocks per step: the first window names the ticket, each next
one the request alone. After the last window (``last``) comes the "done" with the first token
this step sampled.
"""

from __future__ import annotations

import torch

from common.kv_layout import KVCacheLayout
from common.kv_messages import ConnectorStep, PushReport, ReceiveReport, ShardReport, TransferState
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.ticket import KVTicket, TicketError
from kv_transfer.transport import WILDCARDS, advertised, get_transport


class TransferConnector:
    def __init__(
        self,
        *,
        layout: KVCacheLayout,
        kv_caches: list[torch.Tensor],
        model_id: str,
        backend: str = "shm",
        receive: bool = False,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        integrity: str = "crc32",  # none | crc32 | mac: the payload check sent, and the weakest one received
        max_queue: int = 1024,  # items are (request, layer) references, not copies
    ) -> None:
        self.transport = get_transport(backend)
        self.sender = KVSender(layout, model_id, self.transport, max_queue=max_queue, integrity=integrity)
        self.receiver: KVReceiver | None = None
        self.endpoint: str | None = None
        if receive:
            if host in WILDCARDS and advertise_host is None:
                raise ValueError(f"host={host!r} binds every interface, which no peer dials: give advertise_host")
            self.receiver = KVReceiver(kv_caches, layout, backend, require_integrity=integrity)
            # Bound on ``host``; named in tickets as ``advertise_host`` (default: ``host``).
            self.endpoint = advertised(self.transport.serve(self.receiver, host), advertise_host)
        self._step_sends: list[str] = []
        self._step_last: list[str] = []  # of _step_sends, those whose last window this step pushes
        self._open_sends: dict[str, str | None] = {}  # request id -> refusal reason at start, if any
        self._open_receives: set[str] = set()
        self._refused_receives: dict[str, str] = {}  # request id -> why its ticket was not accepted

    def start_step(self, step: ConnectorStep) -> None:
        for request_id in step.forget:
            self.sender.release(request_id)
            if self.receiver is not None:
                self.receiver.release(request_id)
            self._open_sends.pop(request_id, None)
            self._open_receives.discard(request_id)
            self._refused_receives.pop(request_id, None)
        for ticket_dict in step.expects:
            assert self.receiver is not None, "a send-only connector was asked to receive"
            request_id = str(ticket_dict.get("request_id", "?"))
            try:
                self.receiver.expect(KVTicket.from_dict(ticket_dict))
            except (TicketError, KeyError, TypeError, ValueError) as exc:  # a bad ticket fails its request only
                self._refused_receives[request_id] = f"bad ticket: {exc}"
                continue
            self._open_receives.add(request_id)
        for request_id in step.cancel:
            self.sender.cancel(request_id, "the request ended before its prompt was computed")
        self._step_sends, self._step_last = [], []
        for window in step.pushes:
            request_id = window.request_id
            if window.ticket is None:  # the next window of a push this connector started
                if self._open_sends.get(request_id, "not started") is None:
                    self.sender.next_window(request_id, window.block_ids)
                    self._step_sends.append(request_id)
                    if window.last:
                        self._step_last.append(request_id)
                continue
            try:
                self.sender.start(KVTicket.from_dict(window.ticket), window.block_ids)
            except (TicketError, KeyError, TypeError, ValueError) as exc:
                self._open_sends[request_id] = f"bad ticket: {exc}"
                continue
            self._open_sends[request_id] = None
            self._step_sends.append(request_id)
            if window.last:
                self._step_last.append(request_id)

    def after_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        for request_id in self._step_sends:
            self.sender.send_layer(request_id, layer, kv_layer)

    def end_step(self, sampled: dict[str, int] | None) -> ShardReport:
        for request_id in self._step_last:
            self.sender.finish(request_id, (sampled or {}).get(request_id))
        self._step_sends, self._step_last = [], []
        pushes = {}
        for request_id, refused in self._open_sends.items():
            if refused is not None:
                pushes[request_id] = PushReport(TransferState.FAILED, refused)
                continue
            status = self.sender.poll(request_id)
            stats = self.sender.stats(request_id) if status.state.is_terminal else None
            if stats is None:
                pushes[request_id] = PushReport(status.state, status.reason)
            else:
                pushes[request_id] = PushReport(
                    status.state, status.reason, stats.total_time_s, stats.num_bytes, stats.num_windows
                )
        receives = {rid: ReceiveReport(TransferState.FAILED, reason) for rid, reason in self._refused_receives.items()}
        if self.receiver is not None:
            for request_id in self._open_receives:
                rx = self.receiver.poll(request_id)
                receives[request_id] = ReceiveReport(rx.state, rx.reason, rx.first_token_id)
        return ShardReport(pushes, receives)

    def close(self) -> None:
        self.sender.close()
        self.transport.shutdown()
