"""Per-request sampling settings, named like vLLM's ``SamplingParams``.

Validated once at the edge so the engine can trust every field; a bad value raises
``InvalidRequestError`` naming the field and the allowed range. ``to_dict``/``from_dict`` carry it
between processes as plain types (msgpack).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from common.errors import InvalidRequestError
from common.structured_outputs import StructuredOutput

# Below this a temperature is treated as greedy: dividing logits by it would overflow anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
# Stop strings are searched in the new text of every step on the engine thread, and the longest
# one sets how much text a stream holds back: both stay bounded whatever a client sends.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# OpenAI's bounds: at most this many tokens biased, each by a value in [-100, 100] (added to the
# logit: -100 bans a token in practice, 100 forces it).
MAX_LOGIT_BIAS_TOKENS = 300
MAX_LOGIT_BIAS = 100.0
MAX_PRIORITY = 2**31 - 1


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `max_tokens=True` is a client bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if not (_is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(value)  # type: ignore[arg-type]
    except OverflowError:  # an int too large for a float
        return False


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    ``stop`` and ``stop_token_ids`` also accept a str / list and are normalized to tuples, so the
    object stays hashable and immutable. ``top_k`` of 0 or -1 disables top-k. ``logprobs`` is the
    number of top alternatives returned besides the chosen token (0 = chosen token only).
    ``min_tokens``: before that many tokens, EOS and ``stop_token_ids`` cannot be sampled and no stop
    string ends the request (vLLM's rule). ``logit_bias``: (token id, value added to its logit)
    pairs, sorted by id; a dict as OpenAI sends it (ids as strings) is accepted.
    ``prompt_logprobs``: each prompt token's logprob given the tokens before it, with that many top
    alternatives (the prompt is then computed whole: no prefix-cache hits).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    # Not a sampling setting: it rides here to reach the engine's scheduler (scheduling policy
    # "priority": lower first; vLLM's request field).
    priority: int = 0
    # The output's constraint (a JSON schema, regex, choice, grammar, structural tag): each replica
    # compiles it and masks every sampled token to what it allows (engine/structured_output).
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # n > 1 is the router's: it runs n requests of n = 1, whose prompts share cached KV blocks.
        if not _is_int(self.n) or self.n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {self.n!r}", param="n")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens"
            )
        self._check_float("temperature", lambda v: v >= 0, ">= 0")
        self._check_float("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}", param="top_k"
            )
        self._check_float("min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer or null, got {self.seed!r}", param="seed")
        self._check_float("repetition_penalty", lambda v: v > 0, "> 0")
        self._check_float("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        self._check_float("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(
                f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                param="logprobs",
            )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(
                f"prompt_logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
                param="prompt_logprobs",
            )
        if not _is_int(self.priority) or abs(self.priority) > MAX_PRIORITY:
            raise InvalidRequestError(
                f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}",
                param="priority",
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
                param="min_tokens",
            )
        if isinstance(self.structured_output, dict):  # the wire's form (to_dict)
            object.__setattr__(self, "structured_output", StructuredOutput.from_dict(self.structured_output))
        elif self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise InvalidRequestError("structured_output must be a StructuredOutput", param="structured_outputs")
        object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalize_stop_token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean, got {getattr(self, name)!r}", param=name)

    def _check_float(self, name: str, ok: Callable[[float], bool], allowed: str) -> None:
        value = getattr(self, name)
        if not _is_number(value) or not ok(value):
            raise InvalidRequestError(f"{name} must be a number {allowed}, got {value!r}", param=name)
        # Store floats so the dict form (and equality after a round trip) does not depend on 1 vs 1.0.
        object.__setattr__(self, name, float(value))

    def for_choice(self, index: int, score_prompt: bool = True) -> SamplingParams:
        """The params of choice ``index`` of an ``n > 1`` request, run as a request of its own:
        n = 1, and its own seed stream (seed + index, vLLM's rule) when the request is seeded.
        ``score_prompt`` False: no prompt_logprobs (another choice of the prompt scores it)."""
        if self.n == 1 and score_prompt:  # the common request: itself (a replace validates it again)
            return self
        seed = None if self.seed is None else self.seed + index
        prompt_logprobs = self.prompt_logprobs if score_prompt else None
        return replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before picking (logit_bias, min_tokens)."""
        return bool(self.logit_bias) or self.min_tokens > 0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (tuples become lists) so msgpack/json round-trip it unchanged."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, StructuredOutput):
                out[f.name] = value.to_dict()
                continue
            out[f.name] = [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise InvalidRequestError(f"unknown sampling parameter {key!r}", param=key)
        return cls(**data)


def _normalize_stop(stop: object) -> tuple[str, ...]:
    # OpenAI clients send `stop: null` for "no stop strings"; accept it like an empty list.
    if stop is None:
        return ()
    if isinstance(stop, str):
        items: tuple[object, ...] = (stop,)
    elif isinstance(stop, (list, tuple)):
        items = tuple(stop)
    else:
        raise InvalidRequestError(
            f"unknown stop type {type(stop).__name__}: stop must be a string or a list of strings",
            param="stop",
        )
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}", param="stop")
    for item in items:
        if not isinstance(item, str) or not item:
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {item!r}", param="stop")
        if len(item) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of {len(item)}", param="stop"
            )
    return items  # type: ignore[return-value]


def _normalize_stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError(
            f"stop_token_ids must be a list of integers >= 0, got {type(ids).__name__}",
            param="stop_token_ids",
        )
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(ids)}", param="stop_token_ids"
        )
    for token_id in ids:
        if not _is_int(token_id) or token_id < 0:
            raise InvalidRequestError(f"stop_token_ids must be integers >= 0, got {token_id!r}", param="stop_token_ids")
    return tuple(ids)


def _normalize_logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"50256": -100}`` (or the wire's ``[[50256, -100.0]]``) as sorted (id, bias) pairs."""
    if bias is None:
        return ()
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in bias):
        items = [tuple(p) for p in bias]
    else:
        raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
    if len(items) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequestError(
            f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(items)}", param="logit_bias"
        )
    pairs: dict[int, float] = {}
    for key, value in items:
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12
        token_id = key if _is_int(key) else int(key) if digits else None
        if token_id is None or token_id < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}",
                param="logit_bias",
            )
        pairs[token_id] = float(value)
    return tuple(sorted(pairs.items()))
