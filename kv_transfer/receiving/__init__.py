"""The receiving shard's collaborators, composed by ``kv_transfer.receiver.KVReceiver``.

    transfer     IncomingTransfer: one ticket's transfer as this shard sees it, and the keys naming
                 a chunk's place in it (ChunkKey, Window, ...)
    tickets      TicketBook: the tickets expected here and those released
    cache        ReceivingCache: this shard's KV cache as the landings write into it
    checks       ChunkChecks: a chunk authenticated against its ticket and checked against the plan
    completion   Completion: the transfer plan, what has landed, and when a transfer is DONE
    copied       CopiedLanding: a payload (one layer, or a batch of them) copied into the reserved blocks
    pulled       PulledLanding: blocks read in place from the sender's shared memory
    direct       DirectLanding, DirectWrite: a payload the transport receives straight into the blocks

Every method here runs under the receiver's lock unless it says otherwise; none takes the lock.
"""
