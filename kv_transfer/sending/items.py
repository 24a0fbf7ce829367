"""What the compute thread queues for a push, one class per kind of work.

The sending thread takes them in order: a window names the blocks the layers after it are pushed
from, a cancel ends the push once the items before it have left, and the "done" follows the last
layer. The items are built on the forward pass, once per layer: plain and small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LayerItem:
    """Layer ``layer`` of this shard's KV ([2, blocks, block_size, heads, head_dim]), to push."""

    request_id: str
    layer: int
    kv_layer: torch.Tensor
    # CUDA: recorded on the compute stream after the layer's KV write; the transfer stream waits for it.
    ready: torch.cuda.Event | None = None


@dataclass(frozen=True, slots=True)
class WindowItem:
    """The next window: source blocks of the ticket's blocks that follow the last window."""

    request_id: str
    src_block_ids: list[int]


@dataclass(frozen=True, slots=True)
class CancelItem:
    """End the push as failed: its transfer will not be finished."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class DoneItem:
    """Send the "done" after the last layer, with prefill's first sampled token."""

    request_id: str
    first_token_id: int | None


WorkItem = LayerItem | WindowItem | CancelItem | DoneItem
