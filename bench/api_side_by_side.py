"""The same vLLM-client requests to two OpenAI servers (vLLM's and pdserve), answers compared.

    python -m bench.api_side_by_side URL_A MODEL_A URL_B MODEL_B [--out results.json]

Requests: lm-eval's loglikelihood shape (``echo``, ``logprobs: 1``, ``max_tokens: 1``), vLLM's
``prompt_logprobs``, a batch of two prompts, ``n=3`` seeded, chat ``n=2`` seeded, and chat with
``max_tokens`` left out. Printed: whether the echoed tokens and texts are equal, the largest
difference of the prompt's logprobs, whether ``prompt_logprobs`` name the same tokens in the same
order with the same ranks, whether greedy batches are equal, and both chats' default lengths.
Seeded samples are printed, not compared: each server draws from its own generator.
Serve both on the same weights (a float32 Hugging Face directory) for the numbers to compare.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

PROMPT = "The capital of France is Paris. The capital of Italy is"


def ask(url: str, model: str) -> dict[str, Any]:
    import openai

    api = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="x", max_retries=0, timeout=300)
    answers: dict[str, Any] = {}
    r = api.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    answers["loglikelihood"] = {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text": r.choices[0].text}
    r = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    answers["prompt_logprobs"] = (r.choices[0].model_extra or {}).get("prompt_logprobs")
    r = api.completions.create(model=model, prompt=[PROMPT, "Once upon a time"], max_tokens=6, temperature=0)
    answers["batch"] = [(c.index, c.text) for c in r.choices]
    r = api.completions.create(model=model, prompt=PROMPT, n=3, seed=11, temperature=1.0, max_tokens=6)
    answers["n3_seeded"] = [(c.index, c.text) for c in r.choices]
    hi = [{"role": "user", "content": "Say hi"}]
    r = api.chat.completions.create(model=model, messages=hi, n=2, temperature=0.7, seed=3, max_tokens=6)
    answers["chat_n2_seeded"] = [(c.index, c.message.content) for c in r.choices]
    r = api.chat.completions.create(model=model, messages=hi, temperature=0)
    answers["chat_default_max_tokens"] = (r.usage.completion_tokens, r.choices[0].finish_reason)
    return answers


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    la, lb = a["loglikelihood"], b["loglikelihood"]
    pa, pb = a["prompt_logprobs"], b["prompt_logprobs"]
    same_entries, largest = len(pa) == len(pb) and pa[0] is None and pb[0] is None, 0.0
    for ea, eb in zip(pa[1:], pb[1:], strict=False):
        same_entries &= list(ea) == list(eb)
        for key, value in ea.items():
            other = eb.get(key)
            same_entries &= other is not None and (value["rank"], value["decoded_token"]) == (
                other["rank"],
                other["decoded_token"],
            )
            if other is not None:
                largest = max(largest, abs(value["logprob"] - other["logprob"]))
    return {
        "echo_tokens_and_text_equal": la["tokens"] == lb["tokens"] and la["text"] == lb["text"],
        "echo_logprobs_max_abs_diff": max(
            abs(x - y) for x, y in zip(la["token_logprobs"][1:], lb["token_logprobs"][1:], strict=True)
        ),
        "prompt_logprobs_same_tokens_order_ranks": same_entries,
        "prompt_logprobs_max_abs_diff": largest,
        "greedy_batch_equal": a["batch"] == b["batch"],
        "chat_default_max_tokens": [a["chat_default_max_tokens"], b["chat_default_max_tokens"]],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url_a")
    parser.add_argument("model_a")
    parser.add_argument("url_b")
    parser.add_argument("model_b")
    parser.add_argument("--out", default="api_side_by_side.json")
    args = parser.parse_args(argv)
    a, b = ask(args.url_a, args.model_a), ask(args.url_b, args.model_b)
    verdict = compare(a, b)
    print(f"{'check':<42} value")
    for key, value in verdict.items():
        print(f"{key:<42} {value:.2e}" if isinstance(value, float) else f"{key:<42} {value}")
    for key in ("n3_seeded", "chat_n2_seeded"):
        print(f"{key}: A {a[key]}\n{'':<{len(key) + 2}}B {b[key]}")
    with open(args.out, "w") as out:
        json.dump({"a": a, "b": b, "verdict": verdict}, out, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
