"""The receiver's tickets: those it expects chunks for, each with its incoming transfer, and those
it released.

Decode registers a ticket (``add``) before handing it to prefill; chunks for unknown tickets are
refused. Released tickets are remembered, with their secrets, so that their late chunks are told
apart from forged ones: a transport may keep a connection that carried them (chunks of others follow).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from common.kv_layout import KVCacheLayout
from kv_transfer.receiving.transfer import IncomingTransfer
from kv_transfer.state import TransferStats
from kv_transfer.ticket import KVTicket, TicketError

logger = logging.getLogger(__name__)

_REMEMBERED_RELEASES = 4096


class TicketBook:
    def __init__(self, layout: KVCacheLayout, backend: str) -> None:
        self.num_blocks = layout.num_blocks
        self.backend = backend
        self.incoming: dict[str, IncomingTransfer] = {}
        self._released: OrderedDict[str, bytes] = OrderedDict()  # request id -> its ticket's secret

    def check(self, ticket: KVTicket) -> None:
        """Raise TicketError if the ticket names blocks outside this cache. Needs no lock."""
        bad = [b for b in ticket.block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise TicketError(
                f"ticket {ticket.request_id} names blocks {bad[:4]} outside this cache's {self.num_blocks}"
            )

    def add(self, ticket: KVTicket) -> None:
        self._released.pop(ticket.request_id, None)
        self.incoming[ticket.request_id] = IncomingTransfer(ticket, TransferStats(ticket.request_id, self.backend))

    def released_secret(self, request_id: str) -> bytes | None:
        """The secret of a ticket released here (and still remembered), else None."""
        return self._released.get(request_id)

    def forget(self, request_id: str) -> IncomingTransfer | None:
        """Drop the ticket, remember its secret, and cut short the payloads in flight into its blocks
        (their transports' abort hooks); its transfer, to wait for those writes to end."""
        incoming = self.incoming.pop(request_id, None)
        if incoming is None:
            return None
        self._released[request_id] = incoming.ticket.secret
        if len(self._released) > _REMEMBERED_RELEASES:
            self._released.popitem(last=False)
        for abort in [hook for write in incoming.in_flight for hook in write.abort]:
            try:
                abort()
            except Exception:
                logger.exception("aborting a payload in flight for %s failed", request_id)
        return incoming
