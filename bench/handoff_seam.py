"""The engine's step with its hand-off seam: a colocated engine and a prefill + decode engine pair.

What: the hooks every step calls (engine.handoff) sit on the hot path of every engine. This times
the steps where they run, in one process, on the real model:

- colocated: one engine (the null hand-off) decoding ``--num-prompts`` prompts to the end;
- disaggregated: a prefill engine pushing each prompt's KV through the in-process connector into a
  decode engine (the prefill and decode hand-offs), which decodes them to the end, the two stepped
  in turn as a replica's thread would.

Prints a table (seconds, output tokens per second, mean step) and writes
bench/results/handoff_seam.json. Run it in two checkouts to compare them (it uses only the engine's
public API).

    python -m bench.handoff_seam [--num-prompts 16] [--input-len 64] [--output-len 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import exact_length_prompts, print_table, write_json

_CONNECTOR = "kv_transfer.connector:TransferConnector"


def _engine(model_dir, role, dtype: str, connector: dict | None):
    from common.config import CacheConfig, EngineConfig, KVConnectorConfig, ModelConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype=dtype),
            cache=CacheConfig(kv_cache_memory=256 * 2**20),
            scheduler=SchedulerConfig(role=role),
            kv_connector=KVConnectorConfig(_CONNECTOR, connector) if connector is not None else KVConnectorConfig(),
        )
    )


def _colocated(engine, prompts, params) -> tuple[float, int, int]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"c{i}", ids, params)
    steps, tokens, started = 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].new_token_ids) for o in engine.step())
        steps += 1
    return time.perf_counter() - started, tokens, steps


def _disaggregated(prefill, decode, prompts, params, round_: int) -> tuple[float, int, int]:
    from bench.cuda_check import expect_hand_off

    started = time.perf_counter()
    for i, ids in enumerate(prompts):
        request_id = f"d{round_}.{i}"
        prefill.add_request(request_id, ids, params, kv_ticket=expect_hand_off(decode, request_id, ids, params))
    steps, tokens = 0, 0
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        prefill.step()
        tokens += sum(len(o.outputs[0].new_token_ids) for o in decode.step())
        steps += 1
    return time.perf_counter() - started, tokens, steps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    from common.config import EngineRole
    from common.sampling_params import SamplingParams
    from engine.model_loader import resolve_model_dir
    from engine.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(None)
    prompts = exact_length_prompts(load_tokenizer(model_dir), args.num_prompts, args.input_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    colocated = _engine(model_dir, EngineRole.COLOCATED, args.dtype, None)
    prefill = _engine(model_dir, EngineRole.PREFILL, args.dtype, {"backend": "inproc"})
    decode = _engine(model_dir, EngineRole.DECODE, args.dtype, {"backend": "inproc", "receive": True})
    runs: dict[str, list[tuple[float, int, int]]] = {"colocated": [], "disaggregated": []}
    try:
        for round_ in range(args.repeats + 1):  # the first round warms up
            run_c = _colocated(colocated, prompts, params)
            run_d = _disaggregated(prefill, decode, prompts, params, round_)
            if round_:
                runs["colocated"].append(run_c)
                runs["disaggregated"].append(run_d)
    finally:
        for engine in (colocated, prefill, decode):
            engine.shutdown()
    rows = []
    for path, measured in runs.items():
        seconds = statistics.median(s for s, _, _ in measured)
        tokens, steps = measured[0][1], measured[0][2]
        rows.append(
            {
                "path": path,
                "seconds (median)": round(seconds, 3),
                "each run": ", ".join(f"{s:.3f}" for s, _, _ in measured),
                "output tok/s": round(tokens / seconds, 1),
                "steps": steps,
                "ms per step": round(1000 * seconds / steps, 2),
            }
        )
    print_table("the engine's step with its hand-off seam", rows, list(rows[0]))
    payload = {"args": vars(args), "rows": rows}
    write_json("handoff_seam", payload)
    return payload


if __name__ == "__main__":
    main()
