"""bfloat16 against transformers in bfloat16, teacher-forced: the same inputs at every position,
the argmax compared per position. Exact agreement is not expected (bf16 roundings differ in
order), near-total agreement is; a deliberately broken layer must fall well below it.

Both bfloat16 runs are also held against transformers in float32 on the same inputs: pdserve's
bfloat16 must stray from float32 no more than transformers' own bfloat16 does. That is the bar
which holds on every ISA: on AVX-512 and AMX machines oneDNN runs both sides' products; on an
AVX2-only one (no native bfloat16) torch's own loops do. Measured here (2,109 positions): on
AVX-512 the two bf16 runs agreed at 0.9972 and each with float32 at 0.9953; on AVX2 (emulated)
0.9967, pdserve with float32 at 0.9957 and transformers at 0.9953 (docs/benchmarks.md, "bfloat16 on CPUs
without it"). The margins on other inputs: ``python -m bench.bf16_drift``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from bench.bf16_drift import bf16_runner, teacher_forced_logits
from engine import model_runner
from engine.layers.linear import cpu_packing_available, pack_linear_weights
from engine.model_runner import ModelRunner
from tests.conftest import long_text

pytestmark = pytest.mark.slow

NUM_SEQS, PREFILL_LEN, DECODE_LEN = 3, 640, 64  # 3 x 703 = 2,109 positions compared


def hf_argmax(model_dir, sequences: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """transformers' argmax at every position, in ``dtype``: computed once per module."""
    from bench.oracle import load_hf

    with torch.no_grad():
        return load_hf(model_dir, dtype)(torch.tensor(sequences)).logits[:, :-1].argmax(-1)


@pytest.fixture(scope="module")
def hf_bf16_argmax(smol_dir, sequences) -> torch.Tensor:
    return hf_argmax(smol_dir, sequences, torch.bfloat16)


@pytest.fixture(scope="module")
def hf_f32_argmax(smol_dir, sequences) -> torch.Tensor:
    """The reference both bfloat16 runs stray from."""
    return hf_argmax(smol_dir, sequences, torch.float32)


# pdserve's bfloat16 may stray from float32 this much more than transformers' bfloat16 does (in
# share of positions): about 10 of 2,109. Measured, it strayed as much or less (AVX-512, emulated AVX2).
DRIFT_ALLOWANCE = 0.005


@pytest.fixture(scope="module")
def sequences(smol_dir) -> list[list[int]]:
    from engine.tokenizer import load_tokenizer

    ids = load_tokenizer(smol_dir).encode(long_text(60))
    length = PREFILL_LEN + DECODE_LEN
    return [ids[i * 211 : i * 211 + length] for i in range(NUM_SEQS)]


def teacher_forced_argmax(
    runner: ModelRunner, sequences: list[list[int]], one_row_decodes: bool = False
) -> torch.Tensor:
    """[seqs, positions - 1] argmax of our logits, teacher-forced (``bench.bf16_drift``)."""
    return teacher_forced_logits(runner, sequences, PREFILL_LEN, one_row_decodes).argmax(-1)


@dataclass(frozen=True)
class Agreement:
    with_transformers: float  # pdserve bf16 against transformers bf16
    ours_with_f32: float  # pdserve bf16 against transformers float32
    theirs_with_f32: float  # transformers bf16 against transformers float32


def agreement(
    runner: ModelRunner,
    theirs: torch.Tensor,
    f32: torch.Tensor,
    sequences: list[list[int]],
    one_row_decodes: bool = False,
    min_positions: int = 2000,
) -> Agreement:
    ours = teacher_forced_argmax(runner, sequences, one_row_decodes)
    assert ours.shape == theirs.shape == f32.shape and ours.numel() >= min_positions
    return Agreement(*((a == b).float().mean().item() for a, b in ((ours, theirs), (ours, f32), (theirs, f32))))


def check(share: Agreement, what: str) -> None:
    print(f"{what} on {torch.backends.cpu.get_cpu_capability()}: {share}")
    assert share.with_transformers >= 0.99, share
    assert share.ours_with_f32 >= share.theirs_with_f32 - DRIFT_ALLOWANCE, share


def test_bfloat16_agrees_with_transformers_bfloat16(
    smol_dir, hf_bf16_argmax, hf_f32_argmax, sequences, record_property
):
    share = agreement(bf16_runner(smol_dir), hf_bf16_argmax, hf_f32_argmax, sequences)
    record_property("bf16_argmax_agreement", share.with_transformers)
    check(share, "bf16 argmax agreement")


def test_one_row_decode_steps_agree_too(smol_dir, hf_bf16_argmax, hf_f32_argmax, sequences):
    # One-row products take other kernels than batched ones (oneDNN's GEMV on packed weights).
    share = agreement(bf16_runner(smol_dir), hf_bf16_argmax, hf_f32_argmax, sequences, one_row_decodes=True)
    check(share, "one-row decodes")


def test_a_broken_layer_fails_the_agreement_check(smol_dir, hf_bf16_argmax, hf_f32_argmax, sequences, monkeypatch):
    with monkeypatch.context() as patch:  # packing releases the plain weights: break one before packing
        patch.setattr(model_runner, "cpu_packing_available", lambda device, dtype: False)
        runner = bf16_runner(smol_dir)
    with torch.no_grad():
        runner.model.model.layers[12].mlp.down_proj.weight.mul_(-1.0)  # one sign flip in one layer
    if cpu_packing_available(runner.device, runner.dtype):
        pack_linear_weights(runner.model)  # as a bf16 runner on this CPU would have
    # One sequence is enough to fail (703 positions, a third of the cost: on a CPU without native
    # bfloat16 each sequence costs ~15 s); measured 0.92 on all three against the bar's 0.99.
    share = agreement(runner, hf_bf16_argmax[:1], hf_f32_argmax[:1], sequences[:1], min_positions=700)
    print(f"with layer 12's down_proj negated: {share}")
    assert share.with_transformers < 0.99
    assert share.ours_with_f32 < share.theirs_with_f32 - DRIFT_ALLOWANCE
