"""The driver's per-step message to every shard: plain int lists, msgpack on the wire.

Built once per step from the scheduler's chunks, decodes first (see engine.attention.backend).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class StepInput:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    num_decodes: int
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepInput:
        return cls(**data)


def build_step_input(out: SchedulerOutput, block_size: int) -> tuple[StepInput, list[str]]:
    """Flatten scheduled chunks; returns the input and the request ids of the sampled rows, in row order."""
    chunks = sorted(out.chunks, key=lambda c: len(c.token_ids) != 1 or c.start_position == 0)
    num_decodes = sum(1 for c in chunks if len(c.token_ids) == 1 and c.start_position > 0)
    step = StepInput([], [], [], num_decodes, [], [], [], [])
    sampled_ids = []
    for chunk in chunks:
        start, n, blocks = chunk.start_position, len(chunk.token_ids), chunk.block_ids
        step.input_ids.extend(chunk.token_ids)
        positions = range(start, start + n)
        step.positions.extend(positions)
        step.slot_mapping.extend(blocks[p // block_size] * block_size + p % block_size for p in positions)
        step.query_lens.append(n)
        step.seq_lens.append(start + n)
        step.block_tables.append(blocks)
        if chunk.samples:
            step.logits_indices.append(len(step.input_ids) - 1)
            sampled_ids.append(chunk.request_id)
    return step, sampled_ids
