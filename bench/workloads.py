"""Synthetic serving workloads: arrival processes, request-length distributions and real-text prompts.

A workload is a list of ``WorkloadRequest`` sorted by arrival. The load client sends each one at its
arrival time; the simulator reads the same lists with empty prompts. Everything is drawn from one
seeded numpy Generator, so a (name, rate, arrival, seed, ...) tuple always gives the same workload.

The three named workloads follow DistServe's evaluation (OSDI 2024, §6.1): chatbot = ShareGPT,
code completion = HumanEval, summarization = LongBench. We do not ship the datasets; their length
distributions are modelled as log-normals whose means are round-number approximations of published
statistics (each function's docstring says which), not fits to the raw data. ``scale`` shrinks every
length (0.1 → ten times shorter) so the shapes fit a small model's context on a CPU machine.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bench.traces import read_trace
from common.errors import ConfigError


@dataclass(frozen=True)
class WorkloadRequest:
    arrival_s: float  # seconds after the start of the run
    prompt: str  # "" when built without a tokenizer (the simulator needs lengths only)
    num_prompt_tokens: int
    num_output_tokens: int


# ---------------------------------------------------------------- arrival processes
def _check_rate(rate: float, n: int) -> None:
    if not rate > 0:
        raise ConfigError(f"request rate must be > 0 requests/s (math.inf sends all at once), got {rate}")
    if n < 0:
        raise ConfigError(f"number of requests must be >= 0, got {n}")


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    # The first request goes out at t=0 rather than one gap in, so a run never starts idle.
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if len(gaps) else np.zeros(0)


def poisson(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrivals: exponential gaps with mean 1/rate (coefficient of variation 1)."""
    _check_rate(rate, n)
    return np.zeros(n) if math.isinf(rate) else _from_gaps(rng.exponential(1.0 / rate, n))


def gamma(rate: float, n: int, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Gamma-distributed gaps with mean 1/rate and shape 1/burstiness (as ``vllm bench serve --burstiness``).

    The gaps' coefficient of variation is sqrt(burstiness): 1 is Poisson, above 1 burstier, below 1 steadier.
    """
    _check_rate(rate, n)
    if not burstiness > 0:
        raise ConfigError(f"burstiness must be > 0 (1 = Poisson), got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    shape = 1.0 / burstiness
    return _from_gaps(rng.gamma(shape, 1.0 / (rate * shape), n))


def constant(rate: float, n: int) -> np.ndarray:
    """Evenly spaced arrivals, one every 1/rate seconds."""
    _check_rate(rate, n)
    return np.zeros(n) if math.isinf(rate) else np.arange(n) / rate


ARRIVALS = ("poisson", "gamma", "constant")


def arrival_times(kind: str, rate: float, n: int, rng: np.random.Generator, burstiness: float = 1.0) -> np.ndarray:
    if kind == "poisson":
        return poisson(rate, n, rng)
    if kind == "gamma":
        return gamma(rate, n, burstiness, rng)
    if kind == "constant":
        return constant(rate, n)
    raise ConfigError(f"unknown arrival process {kind!r}; known: {', '.join(ARRIVALS)}")


# ---------------------------------------------------------------- request lengths
Lengths = tuple[np.ndarray, np.ndarray]  # (prompt tokens, output tokens), int64


@dataclass(frozen=True)
class LogNormalLengths:
    """Prompt and output lengths, each log-normal with the given mean (tokens) and sigma (of the log)."""

    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float

    @staticmethod
    def median(mean: float, sigma: float) -> float:
        return mean * math.exp(-(sigma**2) / 2)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        # numpy takes the log's mean: mu = ln(mean) - sigma^2 / 2 keeps the requested mean.
        prompt = rng.lognormal(math.log(self.prompt_mean) - self.prompt_sigma**2 / 2, self.prompt_sigma, n)
        output = rng.lognormal(math.log(self.output_mean) - self.output_sigma**2 / 2, self.output_sigma, n)
        return prompt, output


def fit_lengths(prompt: np.ndarray, output: np.ndarray, max_model_len: int, scale: float = 1.0) -> Lengths:
    """Scale, round, and clip so that prompt >= 1, output >= 1 and prompt + output <= max_model_len.

    An over-long request keeps its output and loses prompt tokens, as DistServe truncated LongBench's
    documents to its model's context.
    """
    if max_model_len < 2:
        raise ConfigError(f"max_model_len must be >= 2 (one prompt and one output token), got {max_model_len}")
    if not scale > 0:
        raise ConfigError(f"length scale must be > 0 (0.1 = ten times shorter), got {scale}")
    output = np.clip(np.rint(np.asarray(output, dtype=float) * scale), 1, max_model_len - 1).astype(np.int64)
    prompt = np.maximum(np.rint(np.asarray(prompt, dtype=float) * scale), 1).astype(np.int64)
    return np.minimum(prompt, max_model_len - output), output


# vLLM's paper (SOSP 2023, Fig. 11) reports ShareGPT means of ~161 prompt / ~338 output tokens for first
# turns; DistServe replays conversations with their history as the prompt, which makes prompts several
# times longer. We take the longer-prompt reading.
CHATBOT = LogNormalLengths(prompt_mean=700, prompt_sigma=1.0, output_mean=250, output_sigma=0.8)
# HumanEval: 164 Python problems; a prompt (signature, docstring, examples) is ~150 tokens on average,
# reference solutions are short (~60-100 tokens) with a tail of longer ones.
CODE = LogNormalLengths(prompt_mean=150, prompt_sigma=0.45, output_mean=90, output_sigma=0.6)
# LongBench's English summarization sets (GovReport, QMSum, MultiNews) run to thousands of words per
# document (LongBench's English average is 6,711 words); DistServe truncated them to OPT's 2,048-token
# context, so prompts sit near the context size. Summaries are a few hundred tokens or less.
SUMMARIZATION = LogNormalLengths(prompt_mean=1800, prompt_sigma=0.4, output_mean=150, output_sigma=0.5)


def chatbot(n: int, rng: np.random.Generator, *, max_model_len: int = 2048, scale: float = 1.0) -> Lengths:
    """Chatbot (ShareGPT): heavy-tailed prompts, mean 700 tokens (median ~425); answers mean 250 (median ~180)."""
    return fit_lengths(*CHATBOT.sample(n, rng), max_model_len, scale)


def code(n: int, rng: np.random.Generator, *, max_model_len: int = 2048, scale: float = 1.0) -> Lengths:
    """Code completion (HumanEval): prompts mean 150 tokens (median ~136); completions mean 90 (median ~75)."""
    return fit_lengths(*CODE.sample(n, rng), max_model_len, scale)


def summarization(n: int, rng: np.random.Generator, *, max_model_len: int = 2048, scale: float = 1.0) -> Lengths:
    """Summarization (LongBench, truncated): prompts mean 1,800 tokens (median ~1,660); summaries mean 150."""
    return fit_lengths(*SUMMARIZATION.sample(n, rng), max_model_len, scale)


# Chat turns and pasted documents in one stream: short prompts most of the time, long ones now and
# then (what conditional disaggregation is for: the short ones need no hand-off).
MIXED_SHORT_PROMPT = (16, 160)
MIXED_LONG_PROMPT = (768, 1536)
MIXED_LONG_SHARE = 0.25
MIXED_OUTPUT = (32, 128)


def mixed(n: int, rng: np.random.Generator, *, max_model_len: int = 2048, scale: float = 1.0) -> Lengths:
    """A quarter of prompts long (768–1,536 tokens), the rest short (16–160); outputs 32–128, all uniform."""
    is_long = rng.random(n) < MIXED_LONG_SHARE
    short = rng.integers(*MIXED_SHORT_PROMPT, n, endpoint=True)
    long = rng.integers(*MIXED_LONG_PROMPT, n, endpoint=True)
    output = rng.integers(*MIXED_OUTPUT, n, endpoint=True)
    return fit_lengths(np.where(is_long, long, short), output, max_model_len, scale)


def fixed(input_len: int, output_len: int, n: int, *, max_model_len: int = 2048, scale: float = 1.0) -> Lengths:
    """Every request the same: ``input_len`` prompt tokens, ``output_len`` output tokens."""
    return fit_lengths(np.full(n, input_len), np.full(n, output_len), max_model_len, scale)


def uniform(
    min_in: int,
    max_in: int,
    min_out: int,
    max_out: int,
    n: int,
    rng: np.random.Generator,
    *,
    max_model_len: int = 2048,
    scale: float = 1.0,
) -> Lengths:
    """Prompt and output lengths uniform over the inclusive ranges [min_in, max_in] and [min_out, max_out]."""
    if not (1 <= min_in <= max_in and 1 <= min_out <= max_out):
        raise ConfigError(f"uniform lengths need 1 <= min <= max, got in {min_in}..{max_in}, out {min_out}..{max_out}")
    prompt = rng.integers(min_in, max_in, n, endpoint=True)
    return fit_lengths(prompt, rng.integers(min_out, max_out, n, endpoint=True), max_model_len, scale)


LengthSampler = Callable[..., Lengths]  # (n, rng, *, max_model_len, scale) -> Lengths
WORKLOADS: dict[str, LengthSampler] = {
    "chatbot": chatbot,
    "code": code,
    "summarization": summarization,
    "mixed": mixed,
}
_FORMS = (
    f"{', '.join(WORKLOADS)}, fixed:IN,OUT, uniform:MIN_IN,MAX_IN,MIN_OUT,MAX_OUT, trace:PATH, "
    "multiturn[:SYSTEM_PROMPTS,TURNS[,SYSTEM_TOKENS]]"
)


def length_sampler(name: str) -> LengthSampler:
    """The sampler for a workload name: a registered one, or ``fixed:IN,OUT`` / ``uniform:A,B,C,D``."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    kind, _, args = name.partition(":")
    try:
        values = [int(v) for v in args.split(",")] if args else []
    except ValueError:
        values = []
    if kind == "fixed" and len(values) == 2:
        return lambda n, rng, **kw: fixed(values[0], values[1], n, **kw)
    if kind == "uniform" and len(values) == 4:
        min_in, max_in, min_out, max_out = values
        return lambda n, rng, **kw: uniform(min_in, max_in, min_out, max_out, n, rng, **kw)
    raise ConfigError(f"unknown workload {name!r}; known: {_FORMS}")


# ---------------------------------------------------------------- prompts
_PROSE = """\
The river had been rising for three days when the ferry stopped running. Farmers on the east bank
moved their cattle to the ridge, and the schoolteacher held classes in the church loft, where the
windows looked out over a brown sheet of water that had once been the lower fields.

Modern databases keep a write-ahead log: before a page changes on disk, a record describing the
change is appended to the log and flushed. After a crash, the system replays the log to restore
every committed transaction and undoes those that never finished.

In 1854 John Snow mapped the cholera deaths around Broad Street in London and noticed that they
clustered near a single public pump. He persuaded the parish to remove its handle, and the outbreak,
already waning, faded. The map became a founding document of epidemiology.

To bake a simple loaf, mix flour, water, salt and a little yeast, knead until the dough is smooth,
and leave it covered until it has doubled. Shape it gently, let it rise again, and bake it in a hot
oven until the crust is deep brown and the base sounds hollow when tapped.

Migrating birds navigate with several compasses at once: the position of the sun, the rotation of
the night sky around the pole star, and the Earth's magnetic field, which some species appear to
sense through light-dependent proteins in their eyes.

"""
_CODE = '''\
def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals and return them sorted by start."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class LRUCache:
    """A fixed-capacity mapping that evicts the least recently used key."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: dict[str, int] = {}

    def get(self, key: str) -> int | None:
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key: str, value: int) -> None:
        self.items.pop(key, None)
        self.items[key] = value
        if len(self.items) > self.capacity:
            del self.items[next(iter(self.items))]


def is_palindrome(text: str) -> bool:
    """Return True if text reads the same backwards, ignoring case and non-letters.
    >>> is_palindrome("A man, a plan, a canal: Panama")
    True
    """
    letters = [c.lower() for c in text if c.isalnum()]
    return letters == letters[::-1]

'''
CORPORA = {"prose": _PROSE, "code": _CODE}


@functools.lru_cache(maxsize=8)
def _corpus_ids(tokenizer, corpus: str) -> list[int]:
    return list(tokenizer.encode(CORPORA[corpus], add_special_tokens=False))


def make_prompt(tokenizer, num_tokens: int, seed: int, *, corpus: str = "prose") -> str:
    """Real text that ``tokenizer`` encodes to ``num_tokens`` tokens (±2 at worst, usually exact).

    Slices the corpus's token ids (repeated as needed) at a seed-chosen offset and decodes them, after
    a "[seed]" tag: the corpus is small, and the tag keeps two prompts from sharing a prefix that a
    server's prefix cache would reuse. Decoding and re-encoding can merge tokens at the slice's edges,
    so the slice length is corrected a few times against the re-encoded count. ``tokenizer`` is any
    HF-style tokenizer (encode/decode).
    """
    if num_tokens < 1:
        raise ConfigError(f"a prompt needs >= 1 token, got {num_tokens}")
    if corpus not in CORPORA:
        raise ConfigError(f"unknown corpus {corpus!r}; known: {', '.join(CORPORA)}")
    base = _corpus_ids(tokenizer, corpus)
    offset = int(np.random.default_rng(seed).integers(len(base)))
    tag = list(tokenizer.encode(f"[{seed}] ", add_special_tokens=False))
    ids = tag + (base * ((offset + 2 * num_tokens + 16) // len(base) + 1))[offset:]
    length, best, best_error = num_tokens, "", math.inf
    for _ in range(5):
        text = tokenizer.decode(ids[:length])
        error = len(tokenizer.encode(text, add_special_tokens=False)) - num_tokens
        if abs(error) < best_error:
            best, best_error = text, abs(error)
        if error == 0:
            break
        length = max(1, length - error)
    return best


# ---------------------------------------------------------------- multi-turn chat
@dataclass(frozen=True)
class MultiTurnShape:
    """Conversations that open with one of a few shared system prompts and grow turn by turn: each
    turn's prompt is the one before, that turn's answer and a new user message. What a prefix cache
    (and a router that knows where each prefix is cached) is for."""

    num_system_prompts: int = 4
    system_tokens: int = 256
    turns: int = 4
    user_tokens: int = 48
    assistant_tokens: int = 48  # the earlier answers written into later prompts (a stand-in text)
    output_tokens: int = 48
    think_s: float = 3.0  # mean gap between a conversation's turns (exponential)

    @classmethod
    def parse(cls, name: str) -> MultiTurnShape:
        """``multiturn`` or ``multiturn:SYSTEM_PROMPTS,TURNS[,SYSTEM_TOKENS]``."""
        _, _, args = name.partition(":")
        try:
            values = [int(v) for v in args.split(",")] if args else []
        except ValueError:
            values = []
        if (args and not 2 <= len(values) <= 3) or any(v < 1 for v in values):
            raise ConfigError(
                f"unknown workload {name!r}; multi-turn is multiturn:SYSTEM_PROMPTS,TURNS[,SYSTEM_TOKENS]"
            )
        names = ("num_system_prompts", "turns", "system_tokens")
        return cls(**dict(zip(names, values, strict=False)))


def multiturn(
    shape: MultiTurnShape,
    rate: float,
    num_requests: int,
    rng: np.random.Generator,
    *,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    tokenizer=None,
) -> list[WorkloadRequest]:
    """``num_requests`` turns of ``ceil(num_requests / turns)`` conversations. Conversations start at
    ``rate / turns`` per second (so turns arrive at ``rate`` on average); a conversation's turns
    follow one another ``think_s`` apart on average. Without a tokenizer, prompts are "" and their
    lengths the parts' sums (for the simulator)."""
    num_conversations = -(-num_requests // shape.turns)
    starts = arrival_times(arrival, rate / shape.turns, num_conversations, rng, burstiness)
    text_seeds = iter(rng.integers(2**31, size=num_conversations * shape.turns * 2 + shape.num_system_prompts))

    def text(num_tokens: int) -> str:
        seed = int(next(text_seeds))
        return "" if tokenizer is None else make_prompt(tokenizer, num_tokens, seed)

    systems = [text(shape.system_tokens) for _ in range(shape.num_system_prompts)]
    requests = []
    for start in starts:
        system = int(rng.integers(shape.num_system_prompts))
        prompt, num_tokens, at = f"System: {systems[system]}", shape.system_tokens, float(start)
        for _ in range(shape.turns):
            if len(requests) == num_requests:
                break
            prompt += f"\nUser: {text(shape.user_tokens)}\nAssistant:"
            num_tokens += shape.user_tokens
            exact = len(tokenizer.encode(prompt)) if tokenizer is not None else num_tokens
            requests.append(WorkloadRequest(at, prompt if tokenizer is not None else "", exact, shape.output_tokens))
            prompt += f" {text(shape.assistant_tokens)}"
            num_tokens += shape.assistant_tokens
            at += float(rng.exponential(shape.think_s))
    return sorted(requests, key=lambda r: r.arrival_s)


# ---------------------------------------------------------------- workloads
def build_workload(
    name: str,
    rate: float | None,
    num_requests: int,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
    max_model_len: int = 2048,
    scale: float = 1.0,
    tokenizer=None,
) -> list[WorkloadRequest]:
    """``num_requests`` requests of workload ``name`` arriving at ``rate`` requests/s, sorted by arrival.

    ``name`` is a key of ``WORKLOADS``, ``fixed:IN,OUT``, ``uniform:MIN_IN,MAX_IN,MIN_OUT,MAX_OUT``, or
    ``trace:PATH`` (see bench.traces). A trace keeps its own arrival pattern and lengths (scaled and
    clipped like the rest); a positive ``rate`` stretches its clock so the average rate is ``rate``,
    ``None`` replays it at its recorded pace. Without a tokenizer prompts are "" (for the simulator).
    """
    rng = np.random.default_rng(seed)
    if name == "multiturn" or name.startswith("multiturn:"):
        if rate is None:
            raise ConfigError(f"workload {name!r} needs a request rate")
        requests = multiturn(
            MultiTurnShape.parse(name),
            rate,
            num_requests,
            rng,
            arrival=arrival,
            burstiness=burstiness,
            tokenizer=tokenizer,
        )
        return [r for r in requests if r.num_prompt_tokens + r.num_output_tokens <= max_model_len]
    if name.startswith("trace:"):
        records = read_trace(name.removeprefix("trace:"), max_requests=num_requests)
        arrivals = np.array([r.arrival_s for r in records], dtype=float)
        if rate is not None and len(arrivals) > 1 and arrivals[-1] > 0:
            _check_rate(rate, len(arrivals))
            arrivals *= (len(arrivals) - 1) / (rate * arrivals[-1])
        prompt, output = fit_lengths(
            np.array([r.num_prompt_tokens for r in records]),
            np.array([r.num_output_tokens for r in records]),
            max_model_len,
            scale,
        )
    else:
        sampler = length_sampler(name)
        if rate is None:
            raise ConfigError(f"workload {name!r} needs a request rate")
        arrivals = arrival_times(arrival, rate, num_requests, rng, burstiness)
        prompt, output = sampler(num_requests, rng, max_model_len=max_model_len, scale=scale)
    corpus = "code" if name == "code" else "prose"
    seeds = rng.integers(2**31, size=len(arrivals))
    return [
        WorkloadRequest(
            arrival_s=float(arrivals[i]),
            prompt="" if tokenizer is None else make_prompt(tokenizer, int(prompt[i]), int(seeds[i]), corpus=corpus),
            num_prompt_tokens=int(prompt[i]),
            num_output_tokens=int(output[i]),
        )
        for i in range(len(arrivals))
    ]
