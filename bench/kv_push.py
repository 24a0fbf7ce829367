"""How much of a long prompt's KV transfer its prefill leaves exposed: pushed chunk by chunk
(``push_every_chunk``, the default) against the whole prompt pushed during its last chunk.

    python -m bench.kv_push [--tokens 2048 6144] [--chunk 512] [--backends tcp grpc] [--repeats 3]

A prefill and a decode engine of the default model (float32 or bfloat16, as ``--dtype`` says) run
in this process, the decode engine's receiver behind a real transport; one prompt at a time, the
prefill engine steps its chunks (each step's forward pass pushing its layers as they are
computed), then both engines step until decode has the first token. "exposed ms" is that last
wait: from the end of the step that computed the prompt's last token to the first token leaving
decode, which is the part of the transfer the prompt's compute did not hide (the router's
``kv_transfer_exposed`` share of TTFT). "prefill s" is the prompt's steps, "MB" the KV moved,
"windows" the ranges of blocks it left in. The modes alternate, every prompt is fresh text (no
prefix cache on either side), and each row is the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import exact_length_prompts, print_table, write_json
from common.config import CacheConfig, EngineConfig, EngineRole, KVConnectorConfig, ModelConfig, SchedulerConfig
from engine import SamplingParams
from engine.llm_engine import LLMEngine
from kv_transfer import make_ticket

_CONNECTOR = "kv_transfer.connector:TransferConnector"
_MODES = {"every chunk": True, "last chunk": False}


def _engine(role: EngineRole, backend: str, dtype: str, chunk: int, every_chunk: bool, kv_bytes: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(dtype=dtype),
            cache=CacheConfig(kv_cache_memory=kv_bytes, enable_prefix_caching=False),
            scheduler=SchedulerConfig(role=role, max_prefill_chunk=chunk),
            kv_connector=KVConnectorConfig(
                _CONNECTOR, {"backend": backend, "receive": role is EngineRole.DECODE}, push_every_chunk=every_chunk
            ),
        )
    )


def _one_prompt(prefill: LLMEngine, decode: LLMEngine, backend: str, request_id: str, ids: list[int]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    block_ids = decode.reserve(request_id, ids, params)
    assert block_ids is not None, "the decode engine's KV budget is too small for the prompt"
    ticket = make_ticket(
        request_id, backend, decode.kv_endpoints, decode.layout, decode.model_id, block_ids, len(ids), 120
    ).to_dict()
    decode.expect_kv(request_id, ticket)
    started = time.monotonic()
    prefill.add_request(request_id, ids, params, kv_ticket=ticket)
    prompt_done = None
    while prompt_done is None:
        if any(o.request_id == request_id and o.finished for o in prefill.step()):
            prompt_done = time.monotonic()
    first_token = None
    while first_token is None:
        if any(o.request_id == request_id and o.outputs[0].token_ids for o in decode.step()):
            first_token = time.monotonic()
        prefill.poll_handoffs()
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        prefill.step()
        decode.step()
    sent = prefill.transfers_sent.pop(request_id)
    assert sent.failure is None, sent.failure
    return {
        "prefill_s": prompt_done - started,
        "exposed_ms": (first_token - prompt_done) * 1e3,
        "mb": sent.num_bytes / 1e6,
        "windows": sent.num_windows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 6144])
    parser.add_argument("--chunk", type=int, default=512, help="prompt tokens a prefill step computes")
    parser.add_argument("--backends", nargs="+", default=["tcp", "grpc"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    kv_bytes = 1 << 30
    rows = []
    for backend in args.backends:
        pairs = {
            mode: (
                _engine(EngineRole.PREFILL, backend, args.dtype, args.chunk, every, kv_bytes),
                _engine(EngineRole.DECODE, backend, args.dtype, args.chunk, every, kv_bytes),
            )
            for mode, every in _MODES.items()
        }
        try:
            tokenizer = next(iter(pairs.values()))[0].tokenizer
            for tokens in args.tokens:
                prompts = iter(exact_length_prompts(tokenizer, 2 * args.repeats + 2, tokens))
                runs: dict[str, list[dict]] = {mode: [] for mode in _MODES}
                for mode, (prefill, decode) in pairs.items():  # warm-up: one prompt each, not counted
                    _one_prompt(prefill, decode, backend, f"warm-{mode}-{tokens}", next(prompts))
                for repeat in range(args.repeats):
                    for mode, (prefill, decode) in pairs.items():
                        runs[mode].append(
                            _one_prompt(prefill, decode, backend, f"{mode}-{tokens}-{repeat}", next(prompts))
                        )
                for mode, results in runs.items():
                    row = {"backend": backend, "tokens": tokens, "push": mode}
                    for key in ("prefill_s", "exposed_ms", "mb", "windows"):
                        row[key] = statistics.median(r[key] for r in results)
                    row["exposed_all_ms"] = [round(r["exposed_ms"], 1) for r in results]
                    rows.append(row)
        finally:
            for prefill, decode in pairs.values():
                prefill.shutdown()
                decode.shutdown()
    columns = ["backend", "tokens", "push", "prefill_s", "exposed_ms", "exposed_all_ms", "mb", "windows"]
    print_table(f"KV push of one prompt, chunks of {args.chunk} tokens (median of {args.repeats})", rows, columns)
    write_json("kv_push", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
