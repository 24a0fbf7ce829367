"""How long a prefill step and a decode step take: one interface, two sources.

``AnalyticModel`` is a roofline over a ``ModelShape`` and a ``Hardware`` (DistServe §4.1's latency model in
spirit: compute-bound prefill, bandwidth-bound decode, TP adding all-reduces). ``ProfiledModel`` holds
coefficients fitted by least squares to steps measured on the real engine (``pdserve bench profile``), one set
per tensor-parallel degree, and round-trips through JSON.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from bench.sim.hardware import Hardware
from bench.sim.models import ModelShape

PROFILE_FORMAT = "pdserve-latency-profile/1"


def causal_pairs(num_tokens: int, num_computed: int = 0) -> int:
    """(query, key) pairs of a causal prefill of ``num_tokens`` new tokens after ``num_computed`` cached ones."""
    return num_tokens * num_computed + num_tokens * (num_tokens + 1) // 2


class LatencyModel(ABC):
    """The simulator's only view of cost. Called from the simulator's event loop: pure, fast, never blocks.

    Times are seconds of one step on one replica of ``tp`` shards. A ``tp`` the model cannot serve raises
    ``ValueError``; ``supports_tp`` answers without raising (placement search filters with it).
    """

    @abstractmethod
    def prefill_time(
        self, batch_prompt_tokens: Sequence[int], tp: int, num_computed: Sequence[int] | None = None
    ) -> float:
        """One prefill step over prompts (or chunks) of these lengths; ``num_computed[i]`` tokens of prompt i are
        already in the KV cache (chunked prefill); None means whole prompts."""

    @abstractmethod
    def decode_step_time(self, batch_size: int, total_context_tokens: int, tp: int) -> float:
        """One decode step: ``batch_size`` sequences each emit a token, attending ``total_context_tokens`` in all."""

    @abstractmethod
    def kv_bytes(self, num_tokens: int) -> int:
        """KV-cache bytes of ``num_tokens`` tokens of one sequence, over all shards (what a transfer moves)."""

    @abstractmethod
    def max_kv_tokens(self, tp: int) -> int:
        """Tokens of KV cache one replica of ``tp`` shards holds (0 when the weights alone do not fit)."""

    def supports_tp(self, tp: int) -> bool:
        return tp >= 1

    def mixed_step_time(
        self,
        chunk_tokens: Sequence[int],
        num_computed: Sequence[int],
        batch_size: int,
        total_context_tokens: int,
        tp: int,
    ) -> float:
        """A step that runs prefill chunks and decodes together (chunked prefill, colocated). The default adds the
        two, an upper bound: the real step reads the weights once."""
        time = 0.0
        if chunk_tokens:
            time += self.prefill_time(chunk_tokens, tp, num_computed)
        if batch_size:
            time += self.decode_step_time(batch_size, total_context_tokens, tp)
        return time


@dataclass(frozen=True)
class AnalyticModel(LatencyModel):
    """Roofline: a step takes max(FLOPs / (peak * mfu), bytes / (bandwidth * utilization)) over the shards, plus
    two all-reduces per layer when ``tp > 1``."""

    model: ModelShape
    hw: Hardware

    def supports_tp(self, tp: int) -> bool:
        return tp >= 1 and self.model.num_heads % tp == 0 and self.max_kv_tokens(tp) > 0

    def _check_tp(self, tp: int) -> None:
        if not (tp >= 1 and self.model.num_heads % tp == 0):
            raise ValueError(f"tp={tp} must be >= 1 and divide num_heads={self.model.num_heads} ({self.model.name})")

    def _kv_shards(self, tp: int) -> int:
        # With more shards than KV heads, heads are replicated: each shard still holds one whole head.
        return min(tp, self.model.num_kv_heads)

    def _allreduce_time(self, num_tokens: int, tp: int) -> float:
        """Megatron TP: one all-reduce after attention and one after the MLP per layer; a ring all-reduce sends
        2 * (tp - 1) / tp of the activations over each link."""
        if tp == 1:
            return 0.0
        payload = num_tokens * self.model.hidden_size * self.model.bytes_per_param
        one = self.hw.collective_latency_s + 2 * (tp - 1) / tp * payload / self.hw.interconnect_bandwidth
        return 2 * self.model.num_layers * one

    def _step_time(self, flops: float, weight_bytes: float, kv_bytes: float, num_tokens: int, tp: int) -> float:
        self._check_tp(tp)
        compute = flops / tp / (self.hw.peak_flops * self.hw.mfu)
        memory = (weight_bytes / tp + kv_bytes / self._kv_shards(tp)) / (
            self.hw.memory_bandwidth * self.hw.bandwidth_utilization
        )
        return max(compute, memory) + self._allreduce_time(num_tokens, tp)

    def _prefill_costs(self, lengths: Sequence[int], computed: Sequence[int]) -> tuple[float, float]:
        m = self.model
        tokens = sum(lengths)
        pairs = sum(causal_pairs(n, c) for n, c in zip(lengths, computed, strict=True))
        flops = m.matmul_flops_per_token * tokens + m.lm_head_flops * len(lengths) + m.attention_flops_per_pair * pairs
        kv_bytes = self.kv_bytes(tokens + sum(computed))  # write the new tokens' KV, read the cached prefix
        return flops, kv_bytes

    def _decode_costs(self, batch_size: int, total_context_tokens: int) -> tuple[float, float]:
        m = self.model
        flops = (m.matmul_flops_per_token + m.lm_head_flops) * batch_size
        flops += m.attention_flops_per_pair * total_context_tokens
        return flops, self.kv_bytes(total_context_tokens)

    def prefill_time(
        self, batch_prompt_tokens: Sequence[int], tp: int, num_computed: Sequence[int] | None = None
    ) -> float:
        computed = [0] * len(batch_prompt_tokens) if num_computed is None else num_computed
        flops, kv_bytes = self._prefill_costs(batch_prompt_tokens, computed)
        return self._step_time(flops, self.model.streamed_weight_bytes, kv_bytes, sum(batch_prompt_tokens), tp)

    def decode_step_time(self, batch_size: int, total_context_tokens: int, tp: int) -> float:
        flops, kv_bytes = self._decode_costs(batch_size, total_context_tokens)
        return self._step_time(flops, self.model.streamed_weight_bytes, kv_bytes, batch_size, tp)

    def mixed_step_time(
        self,
        chunk_tokens: Sequence[int],
        num_computed: Sequence[int],
        batch_size: int,
        total_context_tokens: int,
        tp: int,
    ) -> float:
        prefill_flops, prefill_kv = self._prefill_costs(chunk_tokens, num_computed)
        decode_flops, decode_kv = self._decode_costs(batch_size, total_context_tokens)
        num_tokens = sum(chunk_tokens) + batch_size
        weights = self.model.streamed_weight_bytes  # read once for both
        return self._step_time(prefill_flops + decode_flops, weights, prefill_kv + decode_kv, num_tokens, tp)

    def kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.model.kv_bytes_per_token

    def max_kv_tokens(self, tp: int) -> int:
        self._check_tp(tp)
        free_per_shard = self.hw.memory_bytes * self.hw.memory_fraction - self.model.weight_bytes / tp
        bytes_per_token_per_shard = self.model.kv_bytes_per_token / self._kv_shards(tp)
        # Every shard holds its heads' share of each token, so a replica holds as many tokens as one shard does.
        return max(0, int(free_per_shard / bytes_per_token_per_shard))


@dataclass(frozen=True)
class PrefillFit:
    """prefill_time = base_s + per_token_s * sum(lengths) + per_token_sq_s * sum(lengths ** 2)."""

    base_s: float
    per_token_s: float
    per_token_sq_s: float


@dataclass(frozen=True)
class DecodeFit:
    """decode_step_time = base_s + per_seq_s * batch_size + per_context_token_s * total_context_tokens."""

    base_s: float
    per_seq_s: float
    per_context_token_s: float


@dataclass(frozen=True)
class TPProfile:
    """What was measured at one tensor-parallel degree; a missing fit means that phase was not profiled."""

    prefill: PrefillFit | None = None
    decode: DecodeFit | None = None
    max_kv_tokens: int = 0


def _least_squares(rows: list[list[float]], seconds: list[float], what: str) -> list[float]:
    if len(rows) < 3:
        raise ValueError(f"{what}: {len(rows)} samples cannot fit 3 coefficients; measure at least 3 (ideally 10+)")
    coefficients, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(seconds, dtype=float), rcond=None)
    return [float(c) for c in coefficients]


@dataclass(frozen=True)
class ProfiledModel(LatencyModel):
    """Fitted step-time coefficients per TP degree, plus the KV geometry measured alongside them."""

    kv_bytes_per_token: int
    per_tp: Mapping[int, TPProfile] = field(default_factory=dict)
    name: str = ""

    @classmethod
    def fit_prefill(
        cls, samples: list[tuple[list[int], float]], tp: int = 1, kv_bytes_per_token: int = 0, max_kv_tokens: int = 0
    ) -> ProfiledModel:
        """Fit from (prompt lengths of one prefill step, seconds) samples; ``merged`` joins it with a decode fit."""
        rows = [[1.0, float(sum(lengths)), float(sum(n * n for n in lengths))] for lengths, _ in samples]
        fit = PrefillFit(*_least_squares(rows, [s for _, s in samples], f"prefill fit at tp={tp}"))
        return cls(kv_bytes_per_token, {tp: TPProfile(prefill=fit, max_kv_tokens=max_kv_tokens)})

    @classmethod
    def fit_decode(
        cls, samples: list[tuple[int, int, float]], tp: int = 1, kv_bytes_per_token: int = 0, max_kv_tokens: int = 0
    ) -> ProfiledModel:
        """Fit from (batch size, total context tokens, seconds) samples of decode steps."""
        rows = [[1.0, float(batch), float(context)] for batch, context, _ in samples]
        fit = DecodeFit(*_least_squares(rows, [s for *_, s in samples], f"decode fit at tp={tp}"))
        return cls(kv_bytes_per_token, {tp: TPProfile(decode=fit, max_kv_tokens=max_kv_tokens)})

    def merged(self, other: ProfiledModel) -> ProfiledModel:
        """Both models' fits; where both have one for the same TP degree and phase, ``other`` wins."""
        per_tp = dict(self.per_tp)
        for tp, theirs in other.per_tp.items():
            mine = per_tp.get(tp, TPProfile())
            per_tp[tp] = TPProfile(
                prefill=theirs.prefill or mine.prefill,
                decode=theirs.decode or mine.decode,
                max_kv_tokens=theirs.max_kv_tokens or mine.max_kv_tokens,
            )
        return replace(
            self,
            kv_bytes_per_token=other.kv_bytes_per_token or self.kv_bytes_per_token,
            per_tp=per_tp,
            name=other.name or self.name,
        )

    def _profile(self, tp: int) -> TPProfile:
        if tp not in self.per_tp:
            raise ValueError(f"tp={tp} was not profiled; profiled degrees: {sorted(self.per_tp)}")
        return self.per_tp[tp]

    def supports_tp(self, tp: int) -> bool:
        profile = self.per_tp.get(tp)
        return profile is not None and profile.prefill is not None and profile.decode is not None

    def prefill_time(
        self, batch_prompt_tokens: Sequence[int], tp: int, num_computed: Sequence[int] | None = None
    ) -> float:
        fit = self._profile(tp).prefill
        if fit is None:
            raise ValueError(f"prefill was not profiled at tp={tp}; run the profile with prefill samples")
        computed = [0] * len(batch_prompt_tokens) if num_computed is None else num_computed
        # A chunk after c cached tokens costs the growth of the quadratic term: (c + n)^2 - c^2.
        quadratic = sum((c + n) ** 2 - c * c for n, c in zip(batch_prompt_tokens, computed, strict=True))
        # Clamp at zero: a least-squares fit may extrapolate below it far outside the measured range.
        return max(0.0, fit.base_s + fit.per_token_s * sum(batch_prompt_tokens) + fit.per_token_sq_s * quadratic)

    def decode_step_time(self, batch_size: int, total_context_tokens: int, tp: int) -> float:
        fit = self._profile(tp).decode
        if fit is None:
            raise ValueError(f"decode was not profiled at tp={tp}; run the profile with decode samples")
        return max(0.0, fit.base_s + fit.per_seq_s * batch_size + fit.per_context_token_s * total_context_tokens)

    def kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.kv_bytes_per_token

    def max_kv_tokens(self, tp: int) -> int:
        return self._profile(tp).max_kv_tokens

    def to_json(self) -> str:
        per_tp = {
            str(tp): {
                "prefill": None if p.prefill is None else vars(p.prefill),
                "decode": None if p.decode is None else vars(p.decode),
                "max_kv_tokens": p.max_kv_tokens,
            }
            for tp, p in sorted(self.per_tp.items())
        }
        payload = {"format": PROFILE_FORMAT, "name": self.name, "kv_bytes_per_token": self.kv_bytes_per_token}
        return json.dumps({**payload, "per_tp": per_tp}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> ProfiledModel:
        data = json.loads(text)
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"format={data.get('format')!r} is not {PROFILE_FORMAT!r}; re-run `pdserve bench profile`")
        per_tp = {
            int(tp): TPProfile(
                prefill=None if p.get("prefill") is None else PrefillFit(**p["prefill"]),
                decode=None if p.get("decode") is None else DecodeFit(**p["decode"]),
                max_kv_tokens=int(p.get("max_kv_tokens", 0)),
            )
            for tp, p in data.get("per_tp", {}).items()
        }
        return cls(int(data["kv_bytes_per_token"]), per_tp, data.get("name", ""))
