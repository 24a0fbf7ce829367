"""What an output constraint costs: a JSON-schema workload against the same workload unconstrained.

    python -m bench.structured_outputs [--batch 32] [--out results.json]            # the engine, offline
    python -m bench.structured_outputs --url URL --model NAME [--batch 32]          # any OpenAI server

Offline (the default model in pdserve's engine): ``batch`` chat prompts, each asking for a record
of one of eight schemas whose arrays have a fixed number of items (so every answer is long, and
the batch stays whole while it decodes), sampled at temperature 0.7 with seeds. The unconstrained
run sends the same prompts with ``ignore_eos`` and each request's ``max_tokens`` set to the number
of tokens its constrained answer had: the same tokens per request, the same batch at every step.
Printed: throughput (tokens/s), TPOT mean and p50 of each (medians over ``rounds`` runs taken in
turn), the median of the rounds' TPOT ratios, and every answer checked against its schema; then
each schema's compile time on a cold cache (p50, p99 over repeats).

Served (``--url``): the same prompts at concurrency ``batch``, streamed, constrained through
``response_format`` json_schema, then unconstrained (``ignore_eos``, the same ``max_tokens``);
TPOT from each stream's token times. Run it against pdserve and vLLM (structured outputs are on by
default in vLLM, xgrammar backend) in one session to compare them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

NAMES = ("Ana", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal")


def schemas() -> list[dict[str, Any]]:
    """Eight record schemas, each with a fixed-length array (6-13 items)."""
    out = []
    for i in range(8):
        item = {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                "name": {"type": "string", "maxLength": 12},
                "score": {"type": "integer", "minimum": 0, "maximum": 100},
                "active": {"type": "boolean"},
            },
            "required": ["id", "name", "score", "active"],
            "additionalProperties": False,
        }
        out.append(
            {
                "type": "object",
                "properties": {
                    "owner": {"type": "string", "maxLength": 16},
                    "kind": {"enum": ["team", "club", "class"]},
                    "members": {"type": "array", "items": item, "minItems": 6 + i, "maxItems": 6 + i},
                },
                "required": ["owner", "kind", "members"],
                "additionalProperties": False,
            }
        )
    return out


def question(i: int) -> str:
    return f"List the members of {NAMES[i % len(NAMES)]}'s team as JSON, with an id, name, score and active flag each."


def _tpot(first: float | None, last: float | None, num_tokens: int) -> float | None:
    if first is None or last is None or num_tokens < 2:
        return None
    return (last - first) / (num_tokens - 1)


def _summary(tpots: list[float], tokens: int, seconds: float) -> dict[str, float]:
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tpot_mean_ms": 1e3 * statistics.fmean(tpots),
        "tpot_p50_ms": 1e3 * statistics.median(tpots),
    }


def offline(batch: int, rounds: int = 3) -> dict[str, Any]:
    import jsonschema

    from common.sampling_params import SamplingParams
    from common.structured_outputs import ConstraintKind, StructuredOutput
    from engine import LLM

    llm = LLM()
    tokenizer = llm.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question(i)}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for i in range(batch)
    ]
    records = schemas()
    constraints = [StructuredOutput(ConstraintKind.JSON, json.dumps(records[i % len(records)])) for i in range(batch)]
    # Compiled once before timing: the workload's own compiles are measured below, apart.
    llm.generate(prompts[:8], [SamplingParams(max_tokens=1, structured_output=c) for c in constraints[:8]])

    def run(params: list[SamplingParams]) -> tuple[list, float]:
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, time.perf_counter() - started

    constrained_params = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=1024, structured_output=c) for i, c in enumerate(constraints)
    ]
    constrained, constrained_s = run(constrained_params)
    valid = 0
    for output, constraint in zip(constrained, constraints, strict=True):
        completion = output.outputs[0]
        try:
            jsonschema.validate(json.loads(completion.text), json.loads(constraint.spec))
            valid += completion.finish_reason == "stop"
        except (ValueError, jsonschema.ValidationError):
            pass
    lengths = [len(output.outputs[0].token_ids) for output in constrained]
    free_params = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)
    ]

    def summary(outputs: list, seconds: float) -> dict[str, float]:
        tpots = [
            t
            for o in outputs
            if (t := _tpot(o.metrics.first_token_time, o.metrics.finished_time, len(o.outputs[0].token_ids)))
        ]
        return _summary(tpots, sum(len(o.outputs[0].token_ids) for o in outputs), seconds)

    # Rounds in turn (constrained, unconstrained, ...): a 2-core host's drift between two runs was
    # as large as the difference measured; each round's ratio is taken, and their median reported.
    runs: dict[str, list[dict[str, float]]] = {
        "constrained": [summary(constrained, constrained_s)],
        "unconstrained": [],
    }
    for round_index in range(rounds):
        if round_index:
            runs["constrained"].append(summary(*run(constrained_params)))
        runs["unconstrained"].append(summary(*run(free_params)))
    ratios = [
        c["tpot_mean_ms"] / u["tpot_mean_ms"] for c, u in zip(runs["constrained"], runs["unconstrained"], strict=True)
    ]
    result: dict[str, Any] = {"batch": batch, "valid_answers": valid, "rounds": rounds, "tpot_ratios": ratios}
    for name, summaries in runs.items():
        result[name] = {key: statistics.median(s[key] for s in summaries) for key in summaries[0]}
    result["tpot_ratio"] = statistics.median(ratios)
    result["compile"] = compile_times(tokenizer, llm.engine.vocab_size, records)
    llm.shutdown()
    return result


def compile_times(tokenizer: Any, vocab_size: int, records: list[dict], repeats: int = 5) -> dict[str, float]:
    """Each schema compiled ``repeats`` times, each on a cold cache (the tokenizer table built once)."""
    from common.structured_outputs import ConstraintKind, StructuredOutput
    from engine.structured_output import GrammarCompilerPool

    seconds = []
    warm = GrammarCompilerPool(tokenizer, vocab_size)
    warm.submit(StructuredOutput(ConstraintKind.REGEX, "a")).result()  # xgrammar's import, the vocabulary table
    for repeat in range(repeats):
        for schema in records:
            # A distinct title per repeat: the same grammar, a new cache key.
            varied = {**schema, "title": f"r{repeat}"}
            warm.submit(StructuredOutput(ConstraintKind.JSON, json.dumps(varied))).result()
    seconds = warm.stats.take_compile_seconds()[1:]
    warm.shutdown()
    ordered = sorted(seconds)
    return {
        "schemas": len(records),
        "compiles": len(seconds),
        "p50_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def served(url: str, model: str, batch: int) -> dict[str, Any]:
    import concurrent.futures

    import jsonschema
    import openai

    api = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="x", max_retries=0, timeout=600)
    records = schemas()

    def one(i: int, constrained: bool, max_tokens: int) -> tuple[str, list[float]]:
        extra: dict[str, Any] = {}
        if constrained:
            schema = records[i % len(records)]
            extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}
        else:
            extra["extra_body"] = {"ignore_eos": True}
        stream = api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question(i)}],
            temperature=0.7,
            seed=i,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            **extra,
        )
        text, times, tokens = "", [], 0
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                times.append(time.perf_counter())
        return text, [times[0], times[-1], tokens]

    def run(constrained: bool, lengths: list[int]) -> tuple[list, float]:
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(batch) as pool:
            answers = list(pool.map(lambda i: one(i, constrained, lengths[i]), range(batch)))
        return answers, time.perf_counter() - started

    constrained, constrained_s = run(True, [1024] * batch)
    valid = 0
    for i, (text, _) in enumerate(constrained):
        try:
            jsonschema.validate(json.loads(text), records[i % len(records)])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    lengths = [int(timing[2]) for _, timing in constrained]
    free, free_s = run(False, lengths)
    result: dict[str, Any] = {"url": url, "batch": batch, "valid_answers": valid}
    for name, answers, seconds in (("constrained", constrained, constrained_s), ("unconstrained", free, free_s)):
        tpots = [t for _, (first, last, n) in answers if (t := _tpot(first, last, int(n)))]
        result[name] = _summary(tpots, sum(int(n) for _, (_, _, n) in answers), seconds)
    result["tpot_ratio"] = result["constrained"]["tpot_mean_ms"] / result["unconstrained"]["tpot_mean_ms"]
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"batch {result['batch']}: {result['valid_answers']}/{result['batch']} constrained answers validate")
    print(f"{'run':<14}{'tokens':>8}{'tok/s':>9}{'TPOT mean ms':>14}{'TPOT p50 ms':>13}")
    for name in ("constrained", "unconstrained"):
        row = result[name]
        print(
            f"{name:<14}{row['tokens']:>8}{row['tokens_per_s']:>9.1f}{row['tpot_mean_ms']:>14.2f}{row['tpot_p50_ms']:>13.2f}"
        )
    rounds = ", ".join(f"{r:.3f}" for r in result.get("tpot_ratios", []))
    print(
        f"TPOT constrained / unconstrained: {result['tpot_ratio']:.3f}" + (f" (median of {rounds})" if rounds else "")
    )
    if "compile" in result:
        c = result["compile"]
        counts = f"{c['schemas']} schemas, {c['compiles']} cold compiles"
        print(f"compile ({counts}): p50 {c['p50_ms']:.1f} ms, p99 {c['p99_ms']:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--url", help="an OpenAI server to drive instead of the offline engine")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=3, help="offline: constrained and unconstrained runs in turn")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    result = served(args.url, args.model, args.batch) if args.url else offline(args.batch, args.rounds)
    print_table(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
