"""The driver's per-step message to every shard: plain int lists, msgpack on the wire.

Built once per step from the scheduler's chunks, decodes first (see engine.attention.backend).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from engine.request import PLACEHOLDER_TOKEN
from engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    import torch


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
    # Rows whose logits score the prompt's next token (prompt_logprobs), after logits_indices' rows.
    prompt_logprob_indices: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepInput:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class PromptLogprobRows:
    """``count`` rows of a step's prompt-logprob logits, scoring the prompt tokens at positions
    ``first_position + 1`` onwards of one request."""

    request_id: str
    first_position: int
    count: int


def build_step_input(out: SchedulerOutput, block_size: int) -> tuple[StepInput, list[str], list[PromptLogprobRows]]:
    """Flatten scheduled chunks; returns the input, the request ids of the sampled rows in row
    order, and the prompt-logprob rows in row order."""
    chunks = sorted(out.chunks, key=lambda c: len(c.token_ids) != 1 or c.start_position == 0)
    num_decodes = sum(1 for c in chunks if len(c.token_ids) == 1 and c.start_position > 0)
    step = StepInput([], [], [], num_decodes, [], [], [], [])
    sampled_ids = []
    scored: list[PromptLogprobRows] = []
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
        if chunk.num_prompt_logprobs:
            first_row = len(step.input_ids) - n
            step.prompt_logprob_indices.extend(range(first_row, first_row + chunk.num_prompt_logprobs))
            scored.append(PromptLogprobRows(chunk.request_id, start, chunk.num_prompt_logprobs))
    return step, sampled_ids, scored


@dataclass(slots=True)
class CarriedTokens:
    """Input tokens a step takes from the previous step's sampled ids on the device (async
    scheduling: the host has not read them). ``input_index[i]`` of the step's input ids gets row
    ``sampled_rows[i]`` of ``sampled``. Driver only: tensor parallelism runs no step ahead."""

    input_index: list[int]
    sampled_rows: list[int]
    sampled: torch.Tensor


def carried_tokens(
    step: StepInput, step_sampled_ids: list[str], previous_sampled_ids: list[str], previous: torch.Tensor
) -> CarriedTokens | None:
    """Where ``step`` holds placeholders: each is a decode's one token, so a sampled row's own
    position, and its value is the previous step's sample for the same request."""
    row_of = {request_id: row for row, request_id in enumerate(previous_sampled_ids)}
    index, rows = [], []
    for request_id, position in zip(step_sampled_ids, step.logits_indices, strict=True):
        if step.input_ids[position] == PLACEHOLDER_TOKEN:
            index.append(position)
            rows.append(row_of[request_id])
    return CarriedTokens(index, rows, previous) if index else None
