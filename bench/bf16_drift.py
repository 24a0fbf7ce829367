"""How far pdserve's bfloat16 and transformers' bfloat16 each stray from float32, on this CPU.

    python -m bench.bf16_drift [--num-seqs 3 --prefill-len 640 --decode-len 64] [--one-row-decodes]

Teacher-forced on the default model: every position gets the true previous tokens, so each
position's next-token argmax can be compared across three runs on the same inputs: pdserve in
bfloat16 (one prefill step over every sequence, then batched decode steps, as the engine runs
them), transformers in bfloat16 and transformers in float32 (one forward each). Printed and
written as JSON: the argmax agreement of each pair, each bfloat16 run's mean absolute logit error
against float32, and each side's seconds. The ISA decides which kernels both sides run (oneDNN on
AVX-512 and AMX; torch's own loops on AVX2-only CPUs), so the table names it: emulate an AVX2-only
machine on an AVX-512 one with ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2`` (the CPU kernels then build without AVX-512 too).

``tests/engine/test_bfloat16_agreement.py`` runs the same comparison with bars.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.common import print_table, write_json
from common.config import CacheConfig, EngineConfig, ModelConfig
from engine.distributed.parallel import TensorParallel
from engine.model_runner import ModelRunner
from engine.step_input import StepInput

BLOCK = 16


def bf16_runner(model_dir: Path) -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="bfloat16"), cache=CacheConfig(kv_cache_memory=64 * 2**20)
    )
    return ModelRunner(config, model_dir, TensorParallel.single(torch.device("cpu")))


def teacher_forced_logits(
    runner: ModelRunner, sequences: list[list[int]], prefill_len: int, one_row_decodes: bool = False
) -> torch.Tensor:
    """[seqs, positions - 1, vocab] float32 logits of the runner: one prefill step over every
    sequence's first ``prefill_len`` tokens (logits at each position), then one batched decode
    step per later position fed the true next tokens (with ``one_row_decodes``, a step per
    sequence: the one-row products a lightly loaded replica runs). Block tables run backwards so
    that no sequence's blocks are contiguous."""
    num_seqs, length = len(sequences), len(sequences[0])
    blocks_per_seq = -(-length // BLOCK)
    tables = [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))[::-1] for s in range(num_seqs)]

    def slot(s: int, p: int) -> int:
        return tables[s][p // BLOCK] * BLOCK + p % BLOCK

    ids, positions, slots, starts = [], [], [], []
    for s, seq in enumerate(sequences):
        starts.append(len(ids))
        ids += seq[:prefill_len]
        positions += list(range(prefill_len))
        slots += [slot(s, p) for p in range(prefill_len)]
    step = StepInput(
        ids, positions, slots, 0, [prefill_len] * num_seqs, [prefill_len] * num_seqs, tables, list(range(len(ids)))
    )
    logits = runner.execute(step).float()
    rows: list[list[torch.Tensor]] = [[logits[start : start + prefill_len]] for start in starts]
    for p in range(prefill_len, length - 1):
        if one_row_decodes:
            for s, seq in enumerate(sequences):
                step = StepInput([seq[p]], [p], [slot(s, p)], 1, [1], [p + 1], [tables[s]], [0])
                rows[s].append(runner.execute(step).float())
            continue
        step = StepInput(
            [seq[p] for seq in sequences],
            [p] * num_seqs,
            [slot(s, p) for s in range(num_seqs)],
            num_seqs,
            [1] * num_seqs,
            [p + 1] * num_seqs,
            tables,
            list(range(num_seqs)),
        )
        decoded = runner.execute(step).float()
        for s in range(num_seqs):
            rows[s].append(decoded[s : s + 1])
    return torch.stack([torch.cat(r) for r in rows])


def hf_logits(model, sequences: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(sequences)).logits[:, :-1].float()


@dataclass(frozen=True)
class Drift:
    isa: str
    positions: int
    agree_ours_theirs: float  # argmax agreement, pdserve bf16 against transformers bf16
    agree_ours_f32: float
    agree_theirs_f32: float
    logit_error_ours: float  # mean |logit - float32 logit|
    logit_error_theirs: float
    seconds_ours: float
    seconds_theirs: float


def measure(model_dir: Path, sequences: list[list[int]], prefill_len: int, one_row_decodes: bool) -> Drift:
    from bench.oracle import load_hf

    runner = bf16_runner(model_dir)
    start = time.perf_counter()
    ours = teacher_forced_logits(runner, sequences, prefill_len, one_row_decodes)
    seconds_ours = time.perf_counter() - start
    del runner
    hf_bf16 = load_hf(model_dir, torch.bfloat16)
    start = time.perf_counter()
    theirs = hf_logits(hf_bf16, sequences)
    seconds_theirs = time.perf_counter() - start
    del hf_bf16
    reference = hf_logits(load_hf(model_dir), sequences)
    top = [t.argmax(-1) for t in (ours, theirs, reference)]

    def agree(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a == b).float().mean().item()

    return Drift(
        isa=torch.backends.cpu.get_cpu_capability(),
        positions=top[0].numel(),
        agree_ours_theirs=agree(top[0], top[1]),
        agree_ours_f32=agree(top[0], top[2]),
        agree_theirs_f32=agree(top[1], top[2]),
        logit_error_ours=(ours - reference).abs().mean().item(),
        logit_error_theirs=(theirs - reference).abs().mean().item(),
        seconds_ours=seconds_ours,
        seconds_theirs=seconds_theirs,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=3)
    parser.add_argument("--prefill-len", type=int, default=640)
    parser.add_argument("--decode-len", type=int, default=64)
    parser.add_argument("--one-row-decodes", action="store_true")
    args = parser.parse_args()

    from bench.common import exact_length_prompts
    from engine.model_loader import resolve_model_dir
    from engine.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(None)
    sequences = exact_length_prompts(load_tokenizer(model_dir), args.num_seqs, args.prefill_len + args.decode_len)
    drift = measure(model_dir, sequences, args.prefill_len, args.one_row_decodes)
    row = asdict(drift)
    print_table(
        f"bfloat16 against float32 on this CPU ({drift.isa}, {torch.get_num_threads()} threads)", [row], list(row)
    )
    write_json("bf16_drift", {"args": vars(args), "threads": torch.get_num_threads(), **row})


if __name__ == "__main__":
    main()
