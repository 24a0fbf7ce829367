"""The parts of a KVSender (``kv_transfer.sender``), one job each.

items     what the compute thread queues for a push: a layer, a window, a cancel, the "done"
push      one push's state (its ticket, its windows, its TransferState and stats)
book      every push of this sender, behind the one lock the compute thread also takes
worker    the sending thread and its bounded queue: takes the items and dispatches them
pusher    sends a push's layers (choosing the path each takes) and its "done"
paths     the ways a layer's chunk leaves: pulled, in place, copied (staged, batched)
chunks    what every path shares to write a chunk: header, payload check, scratch memory
channels  the channel to each receiver endpoint, and the verdicts posted chunks still owe
"""
