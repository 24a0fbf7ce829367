"""Moving KV blocks from a prefill replica into blocks reserved on a decode replica.

    decode driver        reserve blocks ─▶ KVTicket (endpoints, block ids, layout, lease, secret)
    prefill shard s      KVSender.send_layer(ticket, layer, kv[layer], src blocks)   (per layer, non-blocking)
                         KVSender.finish(ticket, first_token)                        (after the last layer)
    transport            chunks: [signed header | payload] ─▶ receiver endpoint (inproc, shm, grpc, torch, tcp)
    decode shard r       KVReceiver writes into its reserved blocks; poll() ─▶ PENDING/TRANSFERRING/DONE/FAILED

kv_transfer knows tensors, block ids and layouts (``common.kv_layout``), never schedulers.

One word per thing:

    hand-off   one request's passage from prefill to decode: its ticket handed out, its transfer,
               the first token back. The pools and the router speak of it; the engine's driver
               keeps each role's side across its shards (engine.handoff).
    ticket     decode's grant for one request: the blocks it reserved, where to send them, the
               layout, the lease and the secret that signs every chunk (KVTicket).
    transfer   the KV bytes of one hand-off moving between one prefill shard and the decode
               shards; it has a TransferState on each shard (common.kv_messages).
    push       a prefill shard's sending of a transfer (KVSender); it leaves in windows.
    window     a contiguous range of a ticket's blocks pushed in one step: one per prompt chunk
               that completed blocks, the last one followed by the "done".
    chunk      one signed message on the wire, a header and its payload: one or several layers'
               blocks of a window, for a range of KV heads.
    landing    writing a received chunk into the reserved blocks: copied from its payload,
               written in place by the backend, or pulled from the sender's shared cache.
    channel    a sender's connection to one receiver endpoint (KVChannel); a transport makes
               channels and serves receivers (KVTransport).
    connector  the per-shard hook around the forward pass through which the engine drives all
               this (engine.kv_connector); TransferConnector is kv_transfer's. Each step the driver
               sends it a ConnectorStep and it answers with a ShardReport (common.kv_messages).
"""

from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.state import TransferState, TransferStats
from kv_transfer.ticket import KVTicket, TicketError, make_ticket

__all__ = ["KVReceiver", "KVSender", "KVTicket", "TicketError", "TransferState", "TransferStats", "make_ticket"]
