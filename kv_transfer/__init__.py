"""Moving KV blocks from a prefill replica into blocks reserved on a decode replica.

    decode driver        reserve blocks ─▶ KVTicket (endpoints, block ids, layout, lease, secret)
    prefill shard s      KVSender.send_layer(ticket, layer, kv[layer], src blocks)   (per layer, non-blocking)
                         KVSender.finish(ticket, first_token)                        (after the last layer)
    transport            chunks: [signed header | payload] ─▶ receiver endpoint (inproc, shm, grpc, torch, tcp)
    decode shard r       KVReceiver writes into its reserved blocks; poll() ─▶ PENDING/TRANSFERRING/DONE/FAILED

kv_transfer knows tensors, block ids and layouts (``common.kv_layout``), never schedulers.
"""

from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.state import TransferState, TransferStats
from kv_transfer.ticket import KVTicket, TicketError, make_ticket

__all__ = ["KVReceiver", "KVSender", "KVTicket", "TicketError", "TransferState", "TransferStats", "make_ticket"]
