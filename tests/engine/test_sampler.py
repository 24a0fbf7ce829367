from __future__ import annotations

from collections import Counter

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.sampler import (
    Sampler,
    SamplingRequestState,
    apply_penalties,
    greedy_pick,
    make_generator,
)


def row(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> SamplingRequestState:
    generator = make_generator(params.seed) if params.seed is not None else None
    return SamplingRequestState(params, prompt or [], output or [], generator)


def random_logits(num_rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def logits_from_probs(probs: list[float], num_rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(num_rows, 1)


def test_greedy_is_argmax() -> None:
    logits = random_logits(6, 50)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = random_logits(4, 30)
    rows = [row(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, top_k=5)) for i in range(4)]
    out = Sampler()(logits, rows)
    expected = logits.argmax(-1).tolist()
    assert out.sampled_token_ids[0] == expected[0]
    assert out.sampled_token_ids[2] == expected[2]


def test_input_logits_are_not_modified() -> None:
    logits = random_logits(3, 20)
    before = logits.clone()
    rows = [
        row(
            SamplingParams(temperature=0.5, top_p=0.8, top_k=4, min_p=0.1, repetition_penalty=1.5),
            [1, 2],
            [3],
        ),
        row(SamplingParams(presence_penalty=1.0), [], [4]),
        row(SamplingParams(temperature=0.0)),
    ]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


def test_bf16_logits_are_accepted() -> None:
    logits = random_logits(4, 40).bfloat16()
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(seed=3, top_p=0.9, logprobs=2))] * 2
    out = Sampler()(logits, rows)
    assert out.sampled_token_ids[0] == logits.float()[0].argmax().item()
    assert all(0 <= t < 40 for t in out.sampled_token_ids)
    lp = out.logprobs[1]
    assert lp is not None
    expected = torch.log_softmax(logits[1].float(), -1)[out.sampled_token_ids[1]].item()
    assert lp.logprob == pytest.approx(expected, abs=1e-5)


def _seeded_run(seed: int, steps: int, companions: list[SamplingParams], position: int) -> list[int]:
    """Sample `steps` tokens for one seeded row placed at `position` among companion rows."""
    target = row(SamplingParams(seed=seed, temperature=1.0))
    others = [row(p) for p in companions]
    tokens = []
    for step in range(steps):
        rows = list(others)
        rows.insert(position, target)
        base = random_logits(1, 500, seed=100 + step)
        logits = random_logits(len(rows), 500, seed=999 + step)
        logits[position] = base[0]
        tokens.append(Sampler()(logits, rows).sampled_token_ids[position])
    return tokens


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    alone = _seeded_run(seed=7, steps=8, companions=[], position=0)
    assert _seeded_run(seed=7, steps=8, companions=[], position=0) == alone
    companions = [SamplingParams(), SamplingParams(seed=8, top_k=3), SamplingParams(temperature=0.0)]
    assert _seeded_run(seed=7, steps=8, companions=companions, position=0) == alone
    assert _seeded_run(seed=7, steps=8, companions=companions, position=2) == alone
    assert _seeded_run(seed=7, steps=8, companions=companions[::-1], position=3) == alone
    # Companions that switch on top-p / min-p stages must not change this row either.
    assert _seeded_run(seed=7, steps=8, companions=[SamplingParams(top_p=0.5, min_p=0.2)], position=1) == alone


def test_different_seeds_differ() -> None:
    assert _seeded_run(seed=1, steps=6, companions=[], position=0) != _seeded_run(
        seed=2, steps=6, companions=[], position=0
    )


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(8, 64)
    torch.manual_seed(0)
    out = Sampler()(logits, [row(SamplingParams(temperature=2.0, top_k=1)) for _ in range(8)])
    assert out.sampled_token_ids == logits.argmax(-1).tolist()


def _sample_many(probs: list[float], params: SamplingParams, num_rows: int = 4000) -> Counter[int]:
    torch.manual_seed(1234)
    logits = logits_from_probs(probs, num_rows)
    out = Sampler()(logits, [row(params) for _ in range(num_rows)])
    return Counter(out.sampled_token_ids)


def _assert_matches(counts: Counter[int], expected_probs: dict[int, float]) -> None:
    """Only the expected tokens appear, and a loose chi-square test passes."""
    total = sum(counts.values())
    assert set(counts) == set(expected_probs)
    chi2 = sum((counts[t] - total * p) ** 2 / (total * p) for t, p in expected_probs.items())
    # df <= 4; the 0.999 quantile for df=4 is 18.5.
    assert chi2 < 18.5, (counts, expected_probs)


def test_top_k_only_keeps_the_k_best() -> None:
    probs = [0.05, 0.2, 0.1, 0.3, 0.15, 0.2]
    counts = _sample_many(probs, SamplingParams(top_k=3))
    # Tokens 3, 1, 5 are the top 3 (0.3, 0.2, 0.2).
    _assert_matches(counts, {3: 0.3 / 0.7, 1: 0.2 / 0.7, 5: 0.2 / 0.7})


def test_top_k_with_a_larger_vocab() -> None:
    logits = random_logits(1, 200, seed=5).repeat(2000, 1) * 0.1
    torch.manual_seed(0)
    out = Sampler()(logits, [row(SamplingParams(top_k=5)) for _ in range(2000)])
    top5 = set(logits[0].topk(5).indices.tolist())
    assert set(out.sampled_token_ids) == top5


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = [0.1, 0.4, 0.2, 0.3]
    # 0.4 + 0.3 = 0.7 >= 0.65, and no smaller set reaches it.
    counts = _sample_many(probs, SamplingParams(top_p=0.65))
    _assert_matches(counts, {1: 0.4 / 0.7, 3: 0.3 / 0.7})


def test_top_p_always_keeps_the_best_token() -> None:
    counts = _sample_many([0.1, 0.6, 0.3], SamplingParams(top_p=1e-6), num_rows=200)
    assert set(counts) == {1}


def test_top_k_and_top_p_combine() -> None:
    probs = [0.35, 0.25, 0.2, 0.1, 0.1]
    # top-k 3 renormalizes to 0.35/0.8, 0.25/0.8, 0.2/0.8 = .4375/.3125/.25; top-p 0.7 keeps the first two.
    counts = _sample_many(probs, SamplingParams(top_k=3, top_p=0.7))
    _assert_matches(counts, {0: 0.35 / 0.6, 1: 0.25 / 0.6})


def test_min_p_drops_unlikely_tokens() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    # Threshold 0.2 * 0.5 = 0.1: only token 3 goes.
    counts = _sample_many(probs, SamplingParams(min_p=0.2))
    _assert_matches(counts, {0: 0.5 / 0.95, 1: 0.3 / 0.95, 2: 0.15 / 0.95})


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0])
    expected = torch.softmax(logits / 0.5, -1).tolist()
    counts = _sample_many(logits.exp().tolist(), SamplingParams(temperature=0.5))
    _assert_matches(counts, dict(enumerate(expected)))


def test_apply_penalties_matches_the_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5], [1.0, 2.0, 3.0, 4.0, 5.0]])
    out = apply_penalties(
        logits,
        prompt_token_ids=[[0, 0], [4]],
        output_token_ids=[[1, 1, 3], []],
        repetition_penalties=[2.0, 1.0],
        presence_penalties=[0.5, 1.0],
        frequency_penalties=[0.25, 1.0],
    )
    # Row 0: repetition on {0, 1, 3}: 2/2, -1*2, 3/2; then output counts {1: 2, 3: 1}:
    # token 1: -2 - 0.25*2 - 0.5 = -3.0; token 3: 1.5 - 0.25 - 0.5 = 0.75. Prompt-only token 0 gets no
    # presence/frequency penalty; unseen tokens 2 and 4 are untouched.
    # Row 1: repetition 1.0 and no output tokens: unchanged even with presence/frequency set.
    expected = torch.tensor([[1.0, -3.0, 0.5, 0.75, -0.5], [1.0, 2.0, 3.0, 4.0, 5.0]])
    assert torch.allclose(out, expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -0.5]))


def test_apply_penalties_negative_presence_and_repetition_below_one() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.0]])
    out = apply_penalties(logits, [[]], [[0, 1]], [0.5], [-1.0], [0.0])
    # Repetition < 1 boosts: 2/0.5 = 4, -1*0.5 = -0.5; negative presence adds 1.
    assert torch.allclose(out, torch.tensor([[5.0, 0.5, 0.0]]))


def test_sampler_applies_penalties_before_greedy() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0], [3.0, 2.5, 0.0]])
    rows = [
        row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[0]),  # 3/1.5 = 2 < 2.5
        row(SamplingParams(temperature=0.0), prompt=[0]),
    ]
    assert Sampler()(logits, rows).sampled_token_ids == [1, 0]
    rows = [row(SamplingParams(temperature=0.0, frequency_penalty=0.3), output=[0, 0])]  # 3 - 0.6 < 2.5
    assert Sampler()(logits[:1], rows).sampled_token_ids == [1]


def test_logprobs_come_from_raw_logits() -> None:
    logits = random_logits(3, 40, seed=11)
    rows = [
        row(SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, seed=1, logprobs=4), [1, 2, 3]),
        row(SamplingParams(temperature=0.0, logprobs=0)),
        row(SamplingParams()),
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, -1)
    for i in (0, 1):
        lp = out.logprobs[i]
        assert lp is not None
        token = out.sampled_token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(raw[i, token].item(), abs=1e-5)
    assert out.logprobs[2] is None

    first = out.logprobs[0]
    assert first is not None
    top_values, top_ids = raw[0].topk(4)
    assert [token_id for token_id, _ in first.top] == top_ids.tolist()
    assert [logprob for _, logprob in first.top] == pytest.approx(top_values.tolist(), abs=1e-5)
    values = [logprob for _, logprob in first.top]
    assert values == sorted(values, reverse=True)
    assert out.logprobs[1] is not None and out.logprobs[1].top == ()


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, 10), [])
    assert out.sampled_token_ids == [] and out.logprobs == []


def test_make_generator_accepts_negative_and_huge_seeds() -> None:
    a = torch.rand(3, generator=make_generator(-1))
    b = torch.rand(3, generator=make_generator(2**64 - 1))
    assert torch.equal(a, b)
    assert not torch.equal(torch.rand(3, generator=make_generator(0)), a)


def test_greedy_pick_is_argmax_with_ties_going_to_the_first_index():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 1000, generator=g)
    logits[5, [7, 300, 999]] = 100.0  # a three-way tie: the first index wins, as with argmax
    logits[9, :] = 0.0  # a flat row
    picks = greedy_pick(logits)
    assert torch.equal(picks, logits.argmax(dim=-1))
    assert picks[5].item() == 7 and picks[9].item() == 0


def test_a_launched_sample_reads_nothing_a_later_step_can_change() -> None:
    """Everything ``read`` returns is computed at ``launch`` (on CUDA copied to pinned memory
    there too): with steps scheduled ahead, a later step's kernels run before this one is read,
    and a read that copied then would wait for them, or see a buffer they reused."""
    logits = random_logits(2, 40, seed=5)
    rows = [row(SamplingParams(temperature=0.0, logprobs=3)), row(SamplingParams(temperature=0.0))]
    expected = Sampler()(logits.clone(), rows)
    pending = Sampler().launch(logits, rows)
    logits.fill_(0.0)  # as a later step reusing the logits' memory would
    got = pending.read()
    assert got.sampled_token_ids == expected.sampled_token_ids
    assert got.logprobs == expected.logprobs


def test_logit_bias_forces_and_bans_tokens_and_leaves_logprobs_raw() -> None:
    logits = random_logits(2, 50, seed=3)
    best = int(logits[0].argmax())
    forced = SamplingParams(temperature=0, logit_bias={"7": 100}, logprobs=0)
    banned = SamplingParams(temperature=0, logit_bias={str(best): -100})
    out = Sampler()(logits.clone(), [row(forced), row(banned)])
    assert out.sampled_token_ids[0] == 7
    assert out.sampled_token_ids[1] != best and out.sampled_token_ids[1] == int(logits[1].argmax())
    # The logprob is the raw model's, as vLLM reports it by default (not the biased one).
    assert abs(out.logprobs[0].logprob - float(logits[0].log_softmax(-1)[7])) < 1e-5


def test_min_tokens_masks_eos_and_stop_ids_until_reached_and_not_after() -> None:
    logits = torch.full((1, 10), -5.0)
    logits[0, 2], logits[0, 3], logits[0, 4] = 9.0, 8.0, 1.0  # EOS 2 is best, stop id 3 next
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=5, stop_token_ids=[3])

    def pick(output: list[int], eos: tuple[int, ...] = (2,)) -> int:
        state = SamplingRequestState(params, [1], output, None, eos)
        return Sampler()(logits.clone(), [state]).sampled_token_ids[0]

    assert pick([]) == 4 and pick([4]) == 4  # neither EOS nor the stop id while fewer than 2
    assert pick([4, 4]) == 2  # reached: EOS is the best again
    ignoring = SamplingParams(temperature=0, min_tokens=2, max_tokens=5, stop_token_ids=[3], ignore_eos=True)
    state = SamplingRequestState(ignoring, [1], [], None, (2,))
    assert Sampler()(logits.clone(), [state]).sampled_token_ids[0] == 2  # ignore_eos: EOS is just a token
