"""The sender's channels, one per receiver endpoint, and the verdicts their posted chunks still owe.

A chunk posted (a pulled one) or sent under its request's tag over a pipelining channel returns
before the receiver's verdict on it. The sending thread reads those verdicts as they come
(``collect``, between items and while idle) and fails the push a refusal names.
"""

from __future__ import annotations

import logging

from kv_transfer.sending.book import PushBook
from kv_transfer.ticket import KVTicket
from kv_transfer.transport import KVChannel, KVTransport

logger = logging.getLogger("kv_transfer.sender")  # the name operators filter a sender's failures by


class Channels:
    """Used by the sending thread only."""

    def __init__(self, transport: KVTransport, book: PushBook) -> None:
        self.transport = transport
        self.book = book
        self.by_endpoint: dict[str, KVChannel] = {}
        self.posting: set[KVChannel] = set()  # channels with posted chunks' verdicts outstanding

    def to(self, ticket: KVTicket, receiver_rank: int) -> KVChannel:
        endpoint = ticket.receiver_endpoints[receiver_rank]
        channel = self.by_endpoint.get(endpoint)
        if channel is None:
            channel = self.by_endpoint[endpoint] = self.transport.connect(endpoint)
        return channel

    def sent_on(self, channel: KVChannel) -> None:
        """A layer chunk left under its request's tag: a pipelining channel reports its verdict later."""
        if channel.pipelines:
            self.posting.add(channel)

    def collect(self) -> None:
        """Fail the pushes whose posted chunks the receiver refused (or never answered)."""
        for channel in list(self.posting):
            for request_id, error in channel.collect(False, 0.0):
                logger.warning("KV transfer of %s failed: %s", request_id, error)
                self.book.fail_request(request_id, f"{type(error).__name__}: {error}")
            if not channel.num_posted:
                self.posting.discard(channel)
