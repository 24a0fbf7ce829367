"""Vocab-parallel embedding and LM head: shard r owns token rows [r * per_shard, (r + 1) * per_shard).

The vocabulary is padded up to a multiple of the TP degree; padded rows are zero and their
logits are cut before sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel import TensorParallel
from engine.layers.linear import linear
from engine.weights import TensorSource


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_shard = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.per_shard
        self.weight = nn.Parameter(torch.zeros(self.per_shard, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]

    def load(self, param: nn.Parameter, source: TensorSource, shard_id: object = None) -> None:
        size = max(0, min(self.per_shard, self.vocab_size - self.vocab_start))
        param.data.zero_()
        if size:
            param.data[:size].copy_(source.narrow(0, self.vocab_start, size))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_shard)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__(vocab_size, hidden, tp, dtype)
        self.packed: torch.Tensor | None = None  # engine.layers.linear.pack_linear_weights sets it

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocab logits on rank 0 (None elsewhere)."""
        logits = self.tp.gather_last_dim_to_driver(linear(hidden, self.weight, None, self.packed))
        return logits[..., : self.vocab_size] if logits is not None else None
