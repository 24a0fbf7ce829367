"""The engine's KV connector (engine.kv_connector) backed by kv_transfer: one per shard.

A prefill shard pushes each layer of the requests whose prompt completes this step, right after
the layer is computed; a decode shard serves a receiver and registers the tickets it expects.
Reports (msgpack-able) tell the driver each open transfer's state on this shard:

    {"sends":    {request_id: [state, reason, seconds | None, bytes, windows]},  # the last three once terminal
     "receives": {request_id: [state, reason, first_token_id]}}

meta = {"sends":   [{"ticket": KVTicket dict, "block_ids": [...], "last": bool}],  # prefill: push these
        "expects": [KVTicket dict],                                   # decode: accept these
        "forget":  [request_id],                                      # terminal: drop bookkeeping
        "cancel":  [request_id]}                                      # prefill: end a push unfinished

A send is one window of a ticket's blocks, pushed layer by layer during this step: the first names
the ticket, each next one {"request_id", "block_ids"} (the blocks that follow). The last window
("last", the default) is followed by the "done" with the first token this step sampled.
"""

from __future__ import annotations

from typing import Any

import torch

from common.kv_layout import KVCacheLayout
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.state import TransferState
from kv_transfer.ticket import KVTicket, TicketError
from kv_transfer.transport import advertised, get_transport


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
            self.receiver = KVReceiver(kv_caches, layout, backend, require_integrity=integrity)
            # Bound on ``host``; named in tickets as ``advertise_host`` (default: ``host``).
            self.endpoint = advertised(self.transport.serve(self.receiver, host), advertise_host)
        self._step_sends: list[str] = []
        self._step_last: list[str] = []  # of _step_sends, those whose last window this step pushes
        self._open_sends: dict[str, str | None] = {}  # request id -> refusal reason at start, if any
        self._open_receives: set[str] = set()
        self._refused_receives: dict[str, str] = {}  # request id -> why its ticket was not accepted

    def start_step(self, meta: dict[str, Any]) -> None:
        for request_id in meta.get("forget", ()):
            self.sender.release(request_id)
            if self.receiver is not None:
                self.receiver.release(request_id)
            self._open_sends.pop(request_id, None)
            self._open_receives.discard(request_id)
            self._refused_receives.pop(request_id, None)
        for ticket_dict in meta.get("expects", ()):
            assert self.receiver is not None, "a send-only connector was asked to receive"
            request_id = str(ticket_dict.get("request_id", "?"))
            try:
                self.receiver.expect(KVTicket.from_dict(ticket_dict))
            except (TicketError, KeyError, TypeError, ValueError) as exc:  # a bad ticket fails its request only
                self._refused_receives[request_id] = f"bad ticket: {exc}"
                continue
            self._open_receives.add(request_id)
        for request_id in meta.get("cancel", ()):
            self.sender.cancel(request_id, "the request ended before its prompt was computed")
        self._step_sends, self._step_last = [], []
        for item in meta.get("sends", ()):
            if "ticket" not in item:  # the next window of a transfer this connector started
                request_id = str(item.get("request_id", "?"))
                if self._open_sends.get(request_id, "not started") is None:
                    self.sender.next_window(request_id, item["block_ids"])
                    self._step_sends.append(request_id)
                    if item.get("last", True):
                        self._step_last.append(request_id)
                continue
            request_id = str(item.get("ticket", {}).get("request_id", "?"))
            try:
                ticket = KVTicket.from_dict(item["ticket"])
                self.sender.start(ticket, item["block_ids"])
            except (TicketError, KeyError, TypeError, ValueError) as exc:
                self._open_sends[request_id] = f"bad ticket: {exc}"
                continue
            self._open_sends[request_id] = None
            self._step_sends.append(request_id)
            if item.get("last", True):
                self._step_last.append(request_id)

    def after_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        for request_id in self._step_sends:
            self.sender.send_layer(request_id, layer, kv_layer)

    def end_step(self, sampled: dict[str, int] | None) -> dict[str, Any]:
        for request_id in self._step_last:
            self.sender.finish(request_id, (sampled or {}).get(request_id))
        self._step_sends, self._step_last = [], []
        sends = {}
        for request_id, refused in self._open_sends.items():
            if refused is not None:
                sends[request_id] = [int(TransferState.FAILED), refused]
            else:
                status = self.sender.poll(request_id)
                stats = self.sender.stats(request_id) if status.state.is_terminal else None
                seconds = stats.total_time_s if stats is not None else None
                sends[request_id] = [
                    int(status.state),
                    status.reason,
                    seconds,
                    stats.num_bytes if stats else 0,
                    stats.num_windows if stats else 1,
                ]
        receives = {rid: [int(TransferState.FAILED), reason, None] for rid, reason in self._refused_receives.items()}
        if self.receiver is not None:
            for request_id in self._open_receives:
                rx = self.receiver.poll(request_id)
                receives[request_id] = [int(rx.state), rx.reason, rx.first_token_id]
        return {"sends": sends, "receives": receives}

    def close(self) -> None:
        self.sender.close()
        self.transport.shutdown()
