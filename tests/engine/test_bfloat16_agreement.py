"""bfloat16 against transformers in bfloat16, teacher-forced: the same inputs at every position,
the argmax compared per position. Exact agreement is not expected (bf16 roundings differ in
order), near-total agreement is; a deliberately broken layer must fall well below it."""

from __future__ import annotations

import pytest
import torch

from common.config import CacheConfig, EngineConfig, ModelConfig
from engine import model_runner
from engine.distributed.parallel import TensorParallel
from engine.layers.linear import cpu_packing_available, pack_linear_weights
from engine.model_runner import ModelRunner
from engine.step_input import StepInput
from tests.conftest import long_text

pytestmark = pytest.mark.slow

NUM_SEQS, PREFILL_LEN, DECODE_LEN = 3, 640, 64  # 3 x 703 = 2,109 positions compared
BLOCK = 16


@pytest.fixture(scope="module")
def hf_bf16(smol_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.bfloat16)
    return model.eval()


@pytest.fixture(scope="module")
def sequences(smol_dir) -> list[list[int]]:
    from engine.tokenizer import load_tokenizer

    ids = load_tokenizer(smol_dir).encode(long_text(60))
    length = PREFILL_LEN + DECODE_LEN
    return [ids[i * 211 : i * 211 + length] for i in range(NUM_SEQS)]


def teacher_forced_argmax(
    runner: ModelRunner, sequences: list[list[int]], one_row_decodes: bool = False
) -> torch.Tensor:
    """[seqs, positions - 1] argmax of our logits: one prefill step over every prompt (logits at
    each position), then DECODE_LEN - 1 batched decode steps fed the true next tokens (with
    ``one_row_decodes``, a step per sequence: the one-row products a lightly loaded replica runs)."""
    blocks_per_seq = -(-len(sequences[0]) // BLOCK)
    tables = [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))[::-1] for s in range(len(sequences))]

    def slot(s: int, p: int) -> int:
        return tables[s][p // BLOCK] * BLOCK + p % BLOCK

    ids, positions, slots, starts = [], [], [], []
    for s, seq in enumerate(sequences):
        starts.append(len(ids))
        ids += seq[:PREFILL_LEN]
        positions += list(range(PREFILL_LEN))
        slots += [slot(s, p) for p in range(PREFILL_LEN)]
    step = StepInput(
        ids, positions, slots, 0, [PREFILL_LEN] * NUM_SEQS, [PREFILL_LEN] * NUM_SEQS, tables, list(range(len(ids)))
    )
    logits = runner.execute(step)
    rows = [logits[start : start + PREFILL_LEN].argmax(-1) for start in starts]
    decoded: list[list[int]] = [[] for _ in sequences]
    for p in range(PREFILL_LEN, len(sequences[0]) - 1):
        if one_row_decodes:
            for s, seq in enumerate(sequences):
                step = StepInput([seq[p]], [p], [slot(s, p)], 1, [1], [p + 1], [tables[s]], [0])
                decoded[s].append(int(runner.execute(step).argmax(-1).item()))
            continue
        step = StepInput(
            [seq[p] for seq in sequences],
            [p] * NUM_SEQS,
            [slot(s, p) for s in range(NUM_SEQS)],
            NUM_SEQS,
            [1] * NUM_SEQS,
            [p + 1] * NUM_SEQS,
            tables,
            list(range(NUM_SEQS)),
        )
        for s, token in enumerate(runner.execute(step).argmax(-1).tolist()):
            decoded[s].append(token)
    return torch.stack([torch.cat([row, torch.tensor(d)]) for row, d in zip(rows, decoded, strict=True)])


def agreement(runner: ModelRunner, hf, sequences: list[list[int]], one_row_decodes: bool = False) -> float:
    ours = teacher_forced_argmax(runner, sequences, one_row_decodes)
    with torch.no_grad():
        theirs = hf(torch.tensor(sequences)).logits[:, :-1].argmax(-1)
    assert ours.shape == theirs.shape and ours.numel() >= 2000
    return (ours == theirs).float().mean().item()


def bf16_runner(smol_dir) -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model=str(smol_dir), dtype="bfloat16"), cache=CacheConfig(kv_cache_memory=64 * 2**20)
    )
    return ModelRunner(config, smol_dir, TensorParallel.single(torch.device("cpu")))


def test_bfloat16_agrees_with_transformers_bfloat16(smol_dir, hf_bf16, sequences, record_property):
    share = agreement(bf16_runner(smol_dir), hf_bf16, sequences)
    record_property("bf16_argmax_agreement", share)
    print(f"bf16 argmax agreement with transformers bf16: {share:.4f}")
    assert share >= 0.99


def test_one_row_decode_steps_agree_too(smol_dir, hf_bf16, sequences):
    # One-row products take other kernels than batched ones (oneDNN's GEMV on packed weights).
    share = agreement(bf16_runner(smol_dir), hf_bf16, sequences, one_row_decodes=True)
    print(f"bf16 argmax agreement, one-row decode steps: {share:.4f}")
    assert share >= 0.99


def test_a_broken_layer_fails_the_agreement_check(smol_dir, hf_bf16, sequences, monkeypatch):
    with monkeypatch.context() as patch:  # packing releases the plain weights: break one before packing
        patch.setattr(model_runner, "cpu_packing_available", lambda device, dtype: False)
        runner = bf16_runner(smol_dir)
    with torch.no_grad():
        runner.model.model.layers[12].mlp.down_proj.weight.mul_(-1.0)  # one sign flip in one layer
    if cpu_packing_available(runner.device, runner.dtype):
        pack_linear_weights(runner.model)  # as a bf16 runner on this CPU would have
    share = agreement(runner, hf_bf16, sequences)
    print(f"with layer 12's down_proj negated: {share:.4f}")
    assert share < 0.99
