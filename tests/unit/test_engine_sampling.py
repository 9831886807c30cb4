"""Sampling: parameter validation, n-gram proposals, the adaptive speculation controller, the sampler's
distributions and penalties, seeded reproducibility, and that speculative verification samples from the target."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from scipy.stats import chisquare

from cloud.engine.sampler import Sampler
from cloud.engine.sampling_params import SamplingParams
from cloud.engine.sequence import Sequence
from cloud.engine.speculator import expected_tokens, ngram_proposal
from shared.errors import ValidationError

CPU = torch.device("cpu")
# The target p and a draft q that disagrees with it (both full support), over a six-token vocabulary.
TARGET = [0.05, 0.30, 0.10, 0.25, 0.20, 0.10]
DRAFT = [0.30, 0.05, 0.25, 0.10, 0.10, 0.20]
NUM_TRIALS = 20_000
SIGNIFICANCE = 0.001


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """These tensors are tiny; intra-op threads only add contention (hundreds of times slower on a busy host)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def make_seq(
    params: SamplingParams, token_ids: list[int] | None = None, num_prompt_tokens: int | None = None
) -> Sequence:
    tokens = token_ids if token_ids is not None else [0]
    return Sequence(
        seq_id=0,
        request_id="req-0",
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens) if num_prompt_tokens is None else num_prompt_tokens,
        params=params,
        arrival_time=0.0,
    )


# -- SamplingParams validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.2),
        ("n", 0),
        ("top_k", -1),
        ("logprobs", 21),
        ("logprobs", -1),
        ("speculation", "medusa"),
        ("max_tokens", -1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
    ],
)
def test_bad_sampling_params_are_a_validation_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        SamplingParams(**{field: value})
    err = caught.value
    assert err.param == field
    assert err.status_code == 400
    assert err.to_openai()["error"]["param"] == field


def test_boundary_sampling_params_are_accepted() -> None:
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, n=1, logprobs=20, speculation="ngram")
    assert params.is_greedy
    assert not params.needs_processing
    assert SamplingParams(top_k=5).needs_processing


# -- n-gram proposals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("token_ids", "k", "kwargs", "expected"),
    [
        ([1, 2, 3, 4, 1, 2], 2, {}, [3, 4]),  # the last bigram was seen before: propose what followed it
        ([1, 2, 3, 4, 1, 2], 5, {}, [3, 4, 1, 2]),  # at most what is left after the match
        ([1, 2, 3, 9, 5, 3, 7, 1, 2, 3], 2, {}, [9, 5]),  # the longest matching n-gram wins over a later unigram
        ([5, 1, 5, 2, 5], 1, {}, [2]),  # the latest earlier occurrence wins
        ([7, 7, 7], 3, {}, [7]),
        ([1, 2, 3, 4], 3, {}, []),  # no repeat, no proposal
        ([1], 3, {}, []),
        ([], 3, {}, []),
        ([1, 2, 9, 2], 2, {"min_n": 2}, []),  # a unigram match is below min_n
        ([1, 2, 9, 2], 2, {}, [9, 2]),
        ([1, 2, 3, 8, 0, 1, 2, 3], 1, {"max_n": 1}, [8]),  # unigrams only: what followed the earlier 3
    ],
)
def test_ngram_proposal(token_ids: list[int], k: int, kwargs: dict[str, int], expected: list[int]) -> None:
    assert ngram_proposal(token_ids, k, **kwargs) == expected


# -- the speculation controller ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("alpha", "k", "expected"),
    [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 0, 1.0), (0.5, 2, 1.75), (0.8, 1, 1.8), (1.5, 3, 4.0)],
)
def test_expected_tokens(alpha: float, k: int, expected: float) -> None:
    assert expected_tokens(alpha, k) == pytest.approx(expected)


# (the controller's decisions: tests/unit/test_spec_controller.py)


# -- distributions ----------------------------------------------------------------------------------------------
def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(probs))


def test_probs_at_temperature_one_is_the_softmax() -> None:
    probs = Sampler.probs(logits_of(TARGET), SamplingParams())
    assert torch.allclose(probs, torch.tensor(TARGET), atol=1e-6)


def test_temperature_sharpens_the_distribution() -> None:
    probs = Sampler.probs(logits_of(TARGET), SamplingParams(temperature=0.5))
    squared = torch.tensor(TARGET) ** 2
    assert torch.allclose(probs, squared / squared.sum(), atol=1e-6)


def test_top_k_keeps_only_the_k_most_likely_tokens() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0, 0.0], [4.0, 0.0, 1.0, 2.0, 3.0, 5.0]])  # [2, V]
    probs = Sampler.probs(logits, SamplingParams(top_k=3))
    assert (probs > 0).sum(dim=-1).tolist() == [3, 3]
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == {1, 3, 4}
    assert set(torch.nonzero(probs[1]).flatten().tolist()) == {0, 4, 5}
    assert torch.allclose(probs.sum(dim=-1), torch.ones(2))
    kept = torch.softmax(logits[0, [1, 3, 4]], dim=-1)
    assert torch.allclose(probs[0, [1, 3, 4]], kept, atol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    dist = [0.5, 0.2, 0.15, 0.1, 0.05]
    probs = Sampler.probs(logits_of(dist), SamplingParams(top_p=0.65))
    assert torch.allclose(probs, torch.tensor([0.5, 0.2, 0.0, 0.0, 0.0]) / 0.7, atol=1e-6)
    only_top = Sampler.probs(logits_of(dist), SamplingParams(top_p=0.01))
    assert only_top.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    dist = [0.5, 0.2, 0.15, 0.1, 0.05]
    probs = Sampler.probs(logits_of(dist), SamplingParams(min_p=0.25))
    assert torch.allclose(probs, torch.tensor([0.5, 0.2, 0.15, 0.0, 0.0]) / 0.85, atol=1e-6)


def test_combined_filters_leave_a_normalised_distribution() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator)  # [4, V]
    probs = Sampler.probs(logits, SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05))
    assert torch.allclose(probs.sum(dim=-1), torch.ones(4), atol=1e-6)
    assert ((probs > 0).sum(dim=-1) <= 20).all()
    assert (probs >= 0).all()


def test_greedy_sampling_is_the_argmax() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    seqs = [make_seq(SamplingParams(temperature=0.0)), make_seq(SamplingParams(temperature=0.0))]
    assert Sampler(CPU).sample(logits, seqs) == [1, 0]


def test_sampling_never_draws_a_filtered_token() -> None:
    sampler = Sampler(CPU)
    logits = torch.tensor([[1.0, 1.0, 0.9, 0.0, -1.0, 3.0]] * 50)
    seqs = [make_seq(SamplingParams(top_k=2)) for _ in range(50)]
    assert set(sampler.sample(logits, seqs)) <= {0, 1, 5}
    assert 5 in sampler.sample(logits, seqs)


# -- seeded reproducibility -------------------------------------------------------------------------------------
def seeded_draws(seed: int, sibling_index: int = 0, num_draws: int = 30) -> list[int]:
    sampler = Sampler(CPU)
    seq = make_seq(SamplingParams(seed=seed))
    seq.sibling_index = sibling_index
    logits = torch.zeros(1, 64)  # uniform: every draw depends only on the generator
    return [sampler.sample(logits, [seq])[0] for _ in range(num_draws)]


def test_the_same_seed_draws_the_same_tokens() -> None:
    assert seeded_draws(1234) == seeded_draws(1234)


def test_different_seeds_and_siblings_draw_different_tokens() -> None:
    assert seeded_draws(1234) != seeded_draws(4321)
    assert seeded_draws(1234, sibling_index=0) != seeded_draws(1234, sibling_index=1)


def test_the_generator_is_kept_per_sequence_until_released() -> None:
    sampler = Sampler(CPU)
    seq = make_seq(SamplingParams(seed=7))
    generator = sampler.generator(seq)
    assert generator is not None
    assert sampler.generator(seq) is generator
    sampler.release(seq)
    assert sampler.generator(seq) is not generator
    assert sampler.generator(make_seq(SamplingParams())) is None


@pytest.mark.parametrize("seed", [2**62, 2**63 - 1, -(2**62)])
def test_every_accepted_seed_can_be_sampled_with(seed: int) -> None:
    try:
        params = SamplingParams(seed=seed)
    except ValidationError as err:  # rejecting it up front (400) is fine too
        assert err.param == "seed"
        return
    sampler = Sampler(CPU)
    assert len(sampler.sample(torch.zeros(1, 8), [make_seq(params)])) == 1


# -- penalties --------------------------------------------------------------------------------------------------
def test_presence_and_frequency_penalties_lower_generated_tokens_only() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    seq = make_seq(params, token_ids=[0, 1, 2, 2, 3], num_prompt_tokens=2)  # prompt [0, 1], output [2, 2, 3]
    logits = Sampler(CPU).apply_penalties(torch.zeros(6), seq)
    assert logits.tolist() == pytest.approx([0.0, 0.0, -1.0, -0.75, 0.0, 0.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    seq = make_seq(SamplingParams(repetition_penalty=2.0), token_ids=[0, 1, 4], num_prompt_tokens=2)
    logits = torch.tensor([2.0, -1.0, 3.0, -2.0, 1.0, 0.5])
    penalised = Sampler(CPU).apply_penalties(logits, seq)
    assert penalised.tolist() == pytest.approx([1.0, -2.0, 3.0, -2.0, 0.5, 0.5])
    assert logits.tolist() == [2.0, -1.0, 3.0, -2.0, 1.0, 0.5]  # the caller's logits are untouched


def test_no_penalties_returns_the_logits_as_they_are() -> None:
    logits = torch.tensor([1.0, 2.0])
    assert Sampler(CPU).apply_penalties(logits, make_seq(SamplingParams(), [0, 1], 1)) is logits


def test_a_frequency_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.5]])
    plain = make_seq(SamplingParams(temperature=0.0), token_ids=[0, 1, 1], num_prompt_tokens=1)
    penalised = make_seq(
        SamplingParams(temperature=0.0, frequency_penalty=0.5), token_ids=[0, 1, 1], num_prompt_tokens=1
    )
    sampler = Sampler(CPU)
    assert sampler.sample(logits, [plain]) == [1]
    assert sampler.sample(logits, [penalised]) == [2]


# -- speculative verification -----------------------------------------------------------------------------------
def test_greedy_verify_accepts_matching_drafts_then_appends_the_target_choice() -> None:
    logits = torch.eye(6)[[3, 1, 4, 5]] * 5  # target argmax per position: 3, 1, 4, 5    [k+1, V]
    seq = make_seq(SamplingParams(temperature=0.0))
    sampler = Sampler(CPU)
    assert sampler.verify(logits, seq, [3, 1, 4], None) == [3, 1, 4, 5]
    assert sampler.verify(logits, seq, [3, 2, 4], None) == [3, 1]
    assert sampler.verify(logits, seq, [0, 1, 4], None) == [3]


def chi_square_p(counts: list[int], dist: list[float]) -> float:
    total = sum(counts)
    return float(chisquare(counts, [total * p for p in dist]).pvalue)


def first_tokens(draft_probs: list[float] | None, draft_token: int | None) -> tuple[list[int], int]:
    """Run k = 1 verification ``NUM_TRIALS`` times against TARGET; returns the counts of the first emitted token
    and how many drafts were accepted."""
    sampler = Sampler(CPU)
    seq = make_seq(SamplingParams(seed=2024))
    target_logits = logits_of(TARGET).repeat(2, 1)  # [k+1, V]
    q = torch.tensor([draft_probs]) if draft_probs is not None else None  # [k, V]
    rng = random.Random(99)
    counts = [0] * len(TARGET)
    num_accepted = 0
    for _ in range(NUM_TRIALS):
        x = draft_token if draft_token is not None else rng.choices(range(len(TARGET)), weights=draft_probs)[0]
        out = sampler.verify(target_logits, seq, [x], q)
        assert 1 <= len(out) <= 2
        counts[out[0]] += 1
        num_accepted += len(out) - 1
    return counts, num_accepted


def test_chi_square_check_tells_the_two_distributions_apart() -> None:
    rng = random.Random(5)
    counts = [0] * len(TARGET)
    for token in rng.choices(range(len(TARGET)), weights=DRAFT, k=NUM_TRIALS):
        counts[token] += 1
    assert chi_square_p(counts, DRAFT) > SIGNIFICANCE
    assert chi_square_p(counts, TARGET) < SIGNIFICANCE


def test_verify_with_draft_probabilities_samples_from_the_target() -> None:
    counts, num_accepted = first_tokens(DRAFT, None)
    assert chi_square_p(counts, TARGET) > SIGNIFICANCE
    assert chi_square_p(counts, DRAFT) < SIGNIFICANCE
    # Acceptance is sum_x min(p(x), q(x)) (Leviathan et al., 2023).
    expected = sum(min(p, q) for p, q in zip(TARGET, DRAFT, strict=True))
    assert num_accepted / NUM_TRIALS == pytest.approx(
        expected, abs=4 * math.sqrt(expected * (1 - expected) / NUM_TRIALS)
    )


def test_verify_with_ngram_point_masses_samples_from_the_target() -> None:
    proposal = 2
    counts, num_accepted = first_tokens(None, proposal)
    assert chi_square_p(counts, TARGET) > SIGNIFICANCE
    # A point mass would put everything on the proposal; the target gives it only TARGET[proposal].
    tolerance = 4 * math.sqrt(TARGET[proposal] * (1 - TARGET[proposal]) / NUM_TRIALS)
    assert counts[proposal] / NUM_TRIALS == pytest.approx(TARGET[proposal], abs=tolerance)
    assert num_accepted / NUM_TRIALS == pytest.approx(TARGET[proposal], abs=tolerance)


def test_verify_bonus_token_after_full_acceptance_comes_from_the_last_row() -> None:
    sampler = Sampler(CPU)
    seq = make_seq(SamplingParams(seed=3))
    target_logits = torch.full((2, 6), -1e4)  # [k+1, V]
    target_logits[0, 2] = 0.0  # the target is sure of the draft token ...
    target_logits[1, 5] = 0.0  # ... and of the token after it
    assert sampler.verify(target_logits, seq, [2], torch.tensor([DRAFT])) == [2, 5]
