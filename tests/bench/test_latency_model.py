"""The cost models: roofline sanity on datasheet numbers, and the profiled fit recovering known coefficients."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from bench.sim.hardware import HARDWARE, get_hardware
from bench.sim.latency_model import AnalyticModel, DecodeFit, PrefillFit, ProfiledModel, TPProfile
from bench.sim.models import MODELS, get_model

OPT_A100 = AnalyticModel(get_model("opt-13b"), get_hardware("A100-80GB"))


@pytest.mark.parametrize(("name", "billions"), [("smollm2-135m", 0.1345), ("opt-13b", 12.85), ("llama-3-8b", 8.03)])
def test_parameter_counts_match_the_published_sizes(name, billions):
    assert MODELS[name].num_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_kv_bytes_per_token_from_the_shape():
    assert get_model("opt-13b").kv_bytes_per_token == 2 * 40 * 40 * 128 * 2
    assert get_model("llama-3-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # GQA: 8 KV heads
    assert OPT_A100.kv_bytes(100) == 100 * get_model("opt-13b").kv_bytes_per_token


def test_unknown_names_say_what_is_known():
    with pytest.raises(KeyError, match="opt-13b"):
        get_model("opt-14b")
    with pytest.raises(KeyError, match="A100-80GB"):
        get_hardware("A100")
    assert set(HARDWARE) >= {"A100-80GB", "H100-SXM", "H200", "cpu-local"}


def test_prefill_grows_about_linearly_with_tokens():
    times = [OPT_A100.prefill_time([n], 1) for n in (512, 1024, 2048)]
    for shorter, longer in itertools.pairwise(times):
        assert 1.9 < longer / shorter < 2.3  # compute-bound, plus a small quadratic attention term
    # A batch of short prompts costs about what one prompt of the same total does (less attention).
    batched = OPT_A100.prefill_time([512] * 4, 1)
    assert 0.9 * times[2] < batched <= times[2]


def test_decode_step_at_batch_one_is_bandwidth_bound():
    hw, model = OPT_A100.hw, OPT_A100.model
    step = OPT_A100.decode_step_time(1, 1, 1)
    bound = model.weight_bytes / (hw.memory_bandwidth * hw.bandwidth_utilization)  # ~26 GB / (2.0 TB/s * 0.7)
    assert step == pytest.approx(bound, rel=0.05)
    assert 0.012 < step < 0.027  # ~18 ms
    # A bigger batch barely costs more (weights are read once); more context costs its KV reads.
    assert OPT_A100.decode_step_time(16, 16, 1) < 1.05 * step
    assert OPT_A100.decode_step_time(16, 16 * 2048, 1) > 1.5 * step


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallelism_helps_but_never_beyond_one_over_tp(tp):
    for one, many in (
        (OPT_A100.prefill_time([1024], 1), OPT_A100.prefill_time([1024], tp)),
        (OPT_A100.decode_step_time(32, 32 * 800, 1), OPT_A100.decode_step_time(32, 32 * 800, tp)),
    ):
        assert one / tp < many < one


def test_kv_capacity_is_memory_left_after_the_weights():
    model, hw = OPT_A100.model, OPT_A100.hw
    expected = (hw.memory_bytes * hw.memory_fraction - model.weight_bytes) / model.kv_bytes_per_token
    assert OPT_A100.max_kv_tokens(1) == int(expected)  # ~56k tokens
    assert OPT_A100.max_kv_tokens(2) > 2 * OPT_A100.max_kv_tokens(1)  # each shard holds half the weights
    assert OPT_A100.supports_tp(8) and not OPT_A100.supports_tp(3)  # 40 heads split 8 ways, not 3
    with pytest.raises(ValueError, match="tp=3"):
        OPT_A100.prefill_time([10], 3)
    too_big = AnalyticModel(get_model("opt-13b"), get_hardware("cpu-local"))
    assert too_big.max_kv_tokens(1) == 0 and not too_big.supports_tp(1)


def test_a_mixed_step_reads_the_weights_once():
    prefill = OPT_A100.prefill_time([256], 1, [0])
    decode = OPT_A100.decode_step_time(64, 64 * 700, 1)
    mixed = OPT_A100.mixed_step_time([256], [0], 64, 64 * 700, 1)
    assert max(prefill, decode) <= mixed < prefill + decode


def test_chunks_cost_about_what_the_whole_prompt_does():
    whole = OPT_A100.prefill_time([2048], 1)
    chunks = sum(OPT_A100.prefill_time([512], 1, [done]) for done in (0, 512, 1024, 1536))
    assert whole <= chunks < 1.1 * whole  # each chunk re-reads the weights and the cached KV


PREFILL = PrefillFit(base_s=0.004, per_token_s=2e-5, per_token_sq_s=3e-9)
DECODE = DecodeFit(base_s=0.012, per_seq_s=1e-4, per_context_token_s=4e-8)


def _prefill_samples(noise: float = 0.0) -> list[tuple[list[int], float]]:
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(40):
        lengths = [int(n) for n in rng.integers(16, 2048, size=rng.integers(1, 5))]
        seconds = (
            PREFILL.base_s + PREFILL.per_token_s * sum(lengths) + PREFILL.per_token_sq_s * sum(n * n for n in lengths)
        )
        samples.append((lengths, seconds * (1 + noise * rng.standard_normal())))
    return samples


def _decode_samples(noise: float = 0.0) -> list[tuple[int, int, float]]:
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(40):
        batch = int(rng.integers(1, 128))
        context = batch * int(rng.integers(16, 2048))
        seconds = DECODE.base_s + DECODE.per_seq_s * batch + DECODE.per_context_token_s * context
        samples.append((batch, context, seconds * (1 + noise * rng.standard_normal())))
    return samples


def test_profiled_fit_recovers_known_coefficients():
    prefill = ProfiledModel.fit_prefill(_prefill_samples(), tp=1, kv_bytes_per_token=46080, max_kv_tokens=5000)
    decode = ProfiledModel.fit_decode(_decode_samples(), tp=1)
    model = prefill.merged(decode)
    fitted = model.per_tp[1]
    for got, want in ((fitted.prefill, PREFILL), (fitted.decode, DECODE)):
        assert np.allclose(list(vars(got).values()), list(vars(want).values()), rtol=1e-6, atol=1e-12)
    assert fitted.max_kv_tokens == 5000 and model.kv_bytes_per_token == 46080
    assert model.prefill_time([100, 200], 1) == pytest.approx(0.004 + 2e-5 * 300 + 3e-9 * 50000)
    assert model.decode_step_time(8, 4000, 1) == pytest.approx(0.012 + 8e-4 + 4e-8 * 4000)
    assert model.supports_tp(1) and not model.supports_tp(2)


def test_profiled_fit_tolerates_measurement_noise():
    model = ProfiledModel.fit_prefill(_prefill_samples(noise=0.02)).merged(
        ProfiledModel.fit_decode(_decode_samples(0.02))
    )
    assert model.prefill_time([1024], 1) == pytest.approx(
        PREFILL.base_s + PREFILL.per_token_s * 1024 + PREFILL.per_token_sq_s * 1024**2, rel=0.03
    )
    assert model.decode_step_time(64, 64 * 1000, 1) == pytest.approx(
        DECODE.base_s + DECODE.per_seq_s * 64 + DECODE.per_context_token_s * 64000, rel=0.03
    )


def test_profiled_fit_needs_enough_samples_and_profiled_degrees():
    with pytest.raises(ValueError, match="at least 3"):
        ProfiledModel.fit_decode([(1, 10, 0.01), (2, 20, 0.02)])
    model = ProfiledModel.fit_decode(_decode_samples(), tp=2)
    with pytest.raises(ValueError, match=r"tp=1 was not profiled.*\[2\]"):
        model.decode_step_time(1, 10, 1)
    with pytest.raises(ValueError, match="prefill was not profiled"):
        model.prefill_time([10], 2)


def test_profiled_chunks_split_the_quadratic_term_exactly():
    model = ProfiledModel(0, {1: TPProfile(prefill=PREFILL)})
    whole = model.prefill_time([1000], 1)
    chunks = model.prefill_time([400], 1, [0]) + model.prefill_time([600], 1, [400])
    assert chunks == pytest.approx(whole + PREFILL.base_s)  # one more step, one more fixed cost


def test_profiled_json_round_trip():
    model = ProfiledModel(
        kv_bytes_per_token=46080,
        per_tp={1: TPProfile(PREFILL, DECODE, 5000), 2: TPProfile(decode=DECODE, max_kv_tokens=12000)},
        name="smollm2-135m on cpu",
    )
    text = model.to_json()
    assert json.loads(text)["per_tp"]["2"]["prefill"] is None
    assert ProfiledModel.from_json(text) == model
    with pytest.raises(ValueError, match="format"):
        ProfiledModel.from_json(json.dumps({"kv_bytes_per_token": 1}))
