"""The ``pdserve`` command line. Subcommands grow with the system (serve, status, scale, bench)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from common import env


def _cmd_prepare(args: argparse.Namespace) -> int:
    from engine.model_loader import resolve_model_dir

    start = time.monotonic()
    path = resolve_model_dir(args.model, args.cache_dir, args.revision)
    print(f"{path}  ({time.monotonic() - start:.1f} s)")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, top_p=args.top_p, top_k=args.top_k
    )
    with LLM(
        args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        revision=args.revision,
        chat_template=args.chat_template,
    ) as llm:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
        else:
            outputs = llm.generate(args.prompts, params)
    for prompt, output in zip(args.prompts, outputs, strict=True):
        completion = output.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": completion.text,
                        "token_ids": completion.token_ids,
                        "finish_reason": completion.finish_reason,
                    }
                )
            )
        else:
            print(f"### {prompt}\n{completion.text}\n[{completion.finish_reason}, {len(completion.token_ids)} tokens]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    prepare = sub.add_parser("prepare-model", help="convert a model (default: SmolLM2-135M-Instruct) once")
    prepare.add_argument(
        "--model", default=None, help="HF directory, .gguf file or Hub id (org/name); default model if omitted"
    )
    prepare.add_argument("--revision", default=None, help="a Hub id's branch, tag or commit (default: main)")
    prepare.add_argument("--cache-dir", default=None)
    prepare.set_defaults(func=_cmd_prepare)

    generate = sub.add_parser("generate", help="offline generation with the engine (no cluster)")
    generate.add_argument("prompts", nargs="+")
    generate.add_argument("--model", default=None, help="HF directory, .gguf file or Hub id (org/name)")
    generate.add_argument("--revision", default=None, help="a Hub id's branch, tag or commit (default: main)")
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template")
    generate.add_argument("--chat-template", help="with --chat: a template file, or the template inline")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--tensor-parallel-size", "-tp", "--tp", type=int, default=1, metavar="N")
    generate.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    generate.add_argument("--json", action="store_true", help="one JSON object per prompt")
    generate.set_defaults(func=_cmd_generate)

    from cluster.serve_cli import add_subcommands

    add_subcommands(sub)

    # Listed here for --help; main() hands its arguments to bench.plan as they are (its own options).
    sub.add_parser(
        "plan",
        help="propose a starting configuration (pools, TP, replicas) from a latency model and a workload, "
        "written as a config file for `pdserve serve --config` (`pdserve plan --help`)",
        add_help=False,
    )

    bench = sub.add_parser(
        "bench",
        help="experiments: goodput (real clusters), profile (fit a latency model), plan (placement search), "
        "load (one load run against any OpenAI URL), latency (TTFT/TPOT disagg vs colocated), "
        "api (the same vLLM-client requests to two servers, answers compared)",
        description="Each passes its arguments on: `pdserve bench goodput --help` lists them.",
    )
    bench.add_argument("experiment", choices=sorted(BENCHMARKS))
    bench.add_argument("arguments", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)
    return parser


BENCHMARKS = {
    "goodput": "bench.goodput",
    "profile": "bench.profile",
    "plan": "bench.plan",
    "load": "bench.load_client",
    "latency": "bench.serving_latency",
    "router": "bench.router_overhead",
    "api": "bench.api_side_by_side",
}


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    importlib.import_module(BENCHMARKS[args.experiment]).main(args.arguments)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=env.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        import bench.plan

        bench.plan.main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    from common.errors import PdserveError

    try:
        return args.func(args)
    except PdserveError as exc:  # a user error: one clear line, not a traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
