"""Sampler: greedy, seeded reproducibility, filters, penalties, min_tokens, logprobs, distribution."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.core.hashing import BlockHasher
from kvstrata.core.request import Request
from kvstrata.core.sampling_params import MIN_TEMPERATURE, SamplingParams
from kvstrata.worker.sampler import Sampler, apply_filters, apply_penalties

HASHER = BlockHasher.create(16, "test")
EOS = 0
FAST = settings(max_examples=25, deadline=None)


def make_request(params: SamplingParams, prompt: tuple[int, ...] = (5, 6, 7),
                 output: tuple[int, ...] = (), request_id: str = "r") -> Request:
    request = Request(request_id, list(prompt), params.validate(), HASHER)
    for token in output:
        request.append_output(token)
    return request


def logits_from_probs(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(rows, 1)                                       # (rows, V)


def step_logits(step: int, vocab: int = 50) -> torch.Tensor:
    """A flat-ish but step-dependent row, so different seeds diverge quickly."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step)) * 0.5


# --- greedy -----------------------------------------------------------------------------------------


@FAST
@given(rows=st.integers(1, 8), vocab=st.integers(2, 64), seed=st.integers(0, 2**31))
def test_greedy_is_argmax(rows: int, vocab: int, seed: int) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.7)]
    requests = [make_request(params[i % 2]) for i in range(rows)]
    out = Sampler((EOS,))(logits, requests)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * rows


def test_greedy_rows_unaffected_by_random_rows_in_the_batch() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3))
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)
    requests = [make_request(greedy if i % 2 else hot) for i in range(6)]
    out = Sampler((EOS,), seed=0)(logits, requests)
    assert [out.token_ids[i] for i in (1, 3, 5)] == logits[[1, 3, 5]].argmax(dim=-1).tolist()


def test_temperature_to_zero_behaves_like_greedy() -> None:
    logits = torch.arange(20, dtype=torch.float32).flip(0)[None] * 0.1                  # gaps of 0.1, best is 0
    logits = logits.repeat(2000, 1)
    cold = make_request(SamplingParams(temperature=1e-3))
    assert set(Sampler((EOS,), seed=1)(logits, [cold] * 2000).token_ids) == {0}
    # Below MIN_TEMPERATURE the row is taken greedily instead of overflowing float32.
    frozen = make_request(SamplingParams(temperature=MIN_TEMPERATURE / 10))
    assert Sampler((EOS,))(logits[:1] * 1e4, [frozen]).token_ids == [0]


# --- seeds ------------------------------------------------------------------------------------------


def generate(batch_of: list[str], seed_of: dict[str, int], steps: int, sampler: Sampler) -> dict[str, list[int]]:
    """Run `steps` decode steps over a batch in the given order; each request's logits depend only on the step."""
    requests = {name: make_request(SamplingParams(temperature=0.0 if name == "greedy" else 1.0, top_p=0.95,
                                                  seed=seed_of.get(name)), request_id=name) for name in batch_of}
    for step in range(steps):
        logits = torch.stack([step_logits(step) for _ in batch_of])
        out = sampler(logits, [requests[name] for name in batch_of])
        for name, token in zip(batch_of, out.token_ids):
            requests[name].append_output(token)
    return {name: r.output_token_ids for name, r in requests.items()}


SEEDS = {"a": 7, "b": 7, "c": 123}                                      # d and greedy are unseeded


@functools.cache
def generated_alone() -> list[int]:
    return generate(["a"], SEEDS, 12, Sampler((EOS,), seed=999))["a"]


@settings(max_examples=12, deadline=None)
@given(order=st.permutations(["a", "b", "c", "d", "greedy"]), sampler_seed=st.integers(0, 100))
def test_seeded_request_reproduces_across_batch_composition_and_order(order: list[str], sampler_seed: int) -> None:
    alone = generated_alone()
    together = generate(order, SEEDS, 12, Sampler((EOS,), seed=sampler_seed))
    assert together["a"] == alone
    assert together["b"] == alone                                       # same seed, prompt and params
    assert together["c"] != alone


def test_seeded_request_reproduces_after_preemption() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    original = make_request(params)
    sampler = Sampler((EOS,))
    for step in range(10):
        original.append_output(sampler(step_logits(step)[None], [original]).token_ids[0])
    # Recompute from the prompt and the first 6 outputs, in a fresh sampler: the next draws repeat.
    resumed = make_request(params, output=tuple(original.output_token_ids[:6]))
    other = Sampler((EOS,), seed=5)
    for step in range(6, 10):
        resumed.append_output(other(step_logits(step)[None], [resumed]).token_ids[0])
    assert resumed.output_token_ids == original.output_token_ids


def test_different_seeds_give_different_sequences() -> None:
    seeds = {f"s{i}": i for i in range(20)}
    outputs = generate(list(seeds), seeds, 16, Sampler((EOS,)))
    assert len({tuple(tokens) for tokens in outputs.values()}) == len(seeds)


def test_seeded_draws_are_fresh_at_every_step() -> None:
    """The seed is mixed with the step: the same logits at every step must not give the same token."""
    request = make_request(SamplingParams(temperature=1.0, seed=3))
    sampler = Sampler((EOS,))
    for _ in range(30):
        request.append_output(sampler(torch.zeros(1, 10), [request]).token_ids[0])
    assert len(set(request.output_token_ids)) >= 5


def test_unseeded_requests_sample_valid_varied_tokens() -> None:
    request = make_request(SamplingParams(temperature=1.0))
    tokens = Sampler((EOS,))(torch.zeros(500, 10), [request] * 500).token_ids
    assert set(tokens) <= set(range(10)) and len(set(tokens)) == 10


# --- filters ----------------------------------------------------------------------------------------


@FAST
@given(vocab=st.integers(2, 40), k=st.integers(1, 45), seed=st.integers(0, 2**31))
def test_top_k_never_leaves_the_k_largest(vocab: int, k: int, seed: int) -> None:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    allowed = set(logits.topk(min(k, vocab)).indices.tolist())
    request = make_request(SamplingParams(temperature=2.0, top_k=k))
    tokens = Sampler((EOS,), seed=seed)(logits.repeat(400, 1), [request] * 400).token_ids
    assert set(tokens) <= allowed


PROBS = [0.05, 0.5, 0.1, 0.3, 0.05]                                    # sorted: 1 (0.5), 3 (0.3), 2 (0.1), ...


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.4, {1}), (0.75, {1, 3}), (0.85, {1, 3, 2}), (1.0, set(range(5)))])
def test_top_p_keeps_the_smallest_nucleus(top_p: float, nucleus: set[int]) -> None:
    params = SamplingParams(temperature=1.0, top_p=top_p)
    filtered = apply_filters(logits_from_probs(PROBS), [params])[0]
    assert set(torch.isfinite(filtered).nonzero().flatten().tolist()) == nucleus
    tokens = Sampler((EOS,), seed=2)(logits_from_probs(PROBS, 3000), [make_request(params)] * 3000).token_ids
    assert set(tokens) == nucleus


def test_top_p_renormalizes_inside_the_nucleus() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.75)
    tokens = Sampler((EOS,), seed=3)(logits_from_probs(PROBS, 20000), [make_request(params)] * 20000).token_ids
    assert tokens.count(1) / len(tokens) == pytest.approx(0.5 / 0.8, abs=0.015)


def test_top_k_then_top_p() -> None:
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.7)       # top-k leaves {1: 0.625, 3: 0.375}
    filtered = apply_filters(logits_from_probs(PROBS), [params])[0]
    assert torch.isfinite(filtered).nonzero().flatten().tolist() == [1, 3]


@pytest.mark.parametrize(("min_p", "kept"), [(0.25, {1, 3}), (0.15, {1, 3, 2}), (0.7, {1})])
def test_min_p_cuts_relative_to_the_best_token(min_p: float, kept: set[int]) -> None:
    params = SamplingParams(temperature=1.0, min_p=min_p)
    filtered = apply_filters(logits_from_probs(PROBS), [params])[0]
    assert set(torch.isfinite(filtered).nonzero().flatten().tolist()) == kept
    tokens = Sampler((EOS,), seed=4)(logits_from_probs(PROBS, 3000), [make_request(params)] * 3000).token_ids
    assert set(tokens) == kept


def test_filters_apply_per_row() -> None:
    params = [SamplingParams(top_k=1, temperature=1.0), SamplingParams(temperature=0.5),
              SamplingParams(min_p=0.7), SamplingParams(top_p=0.4)]
    filtered = apply_filters(logits_from_probs(PROBS, 4), params)
    assert torch.isfinite(filtered).sum(dim=-1).tolist() == [1, 5, 1, 1]
    assert torch.allclose(filtered[1], logits_from_probs(PROBS)[0] / 0.5)


# --- penalties --------------------------------------------------------------------------------------


def test_penalties_match_a_hand_computation() -> None:
    vocab = 8
    logits = torch.tensor([[1.0, -2.0, 3.0, -0.5, 0.0, 2.5, -1.0, 0.7],
                           [0.3, 0.1, -0.2, 0.4, 0.5, 0.6, 0.7, 0.8]])
    before = logits.clone()
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    penalized = make_request(params, prompt=(1, 2, 2, 6), output=(2, 3, 3, 3))
    plain = make_request(SamplingParams(), prompt=(1, 2), output=(3,))
    out = apply_penalties(logits, [penalized, plain], eos_token_ids=(EOS,))

    expected = logits[0].tolist()
    for token in range(vocab):
        if token in penalized.token_ids:                                 # repetition: prompt + output
            expected[token] = expected[token] / 1.3 if expected[token] > 0 else expected[token] * 1.3
        count = penalized.output_token_ids.count(token)                  # presence/frequency: output only
        expected[token] -= 0.2 * count + 0.5 * (count > 0)
    assert out[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.equal(out[1], logits[1])
    assert torch.equal(logits, before), "the caller's logits are read for logprobs and must not change"


def test_penalties_change_what_greedy_picks() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    assert Sampler((EOS,))(logits, [make_request(params, output=(1,))]).token_ids == [2]
    assert Sampler((EOS,))(logits, [make_request(params)]).token_ids == [1]


# --- min_tokens -------------------------------------------------------------------------------------


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[9.0, 0.0, 8.0, 7.0, 0.0]])                  # EOS (0) first, stop id 2 next
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(2,))
    sampler = Sampler((EOS, 4))
    for produced in range(3):
        assert sampler(logits, [make_request(params, output=(3,) * produced)]).token_ids == [3]
    assert sampler(logits, [make_request(params, output=(3, 3, 3))]).token_ids == [EOS]


def test_min_tokens_blocks_eos_when_sampling() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0]]).repeat(2000, 1)
    request = make_request(SamplingParams(temperature=1.0, min_tokens=2))
    assert EOS not in Sampler((EOS,), seed=6)(logits, [request] * 2000).token_ids


def test_ignore_eos_leaves_eos_to_min_tokens_but_still_blocks_stop_ids() -> None:
    logits = torch.tensor([[9.0, 0.0, 8.0, 7.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(2,), ignore_eos=True)
    assert Sampler((EOS,))(logits, [make_request(params)]).token_ids == [EOS]
    blocked = apply_penalties(logits, [make_request(params)], (EOS,))
    assert blocked[0].tolist() == [9.0, 0.0, float("-inf"), 7.0]


# --- logprobs ---------------------------------------------------------------------------------------


def test_logprobs_are_raw_and_sorted_best_first() -> None:
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(8))
    raw = logits.log_softmax(dim=-1)
    requests = [make_request(SamplingParams(temperature=0.8, logprobs=4, repetition_penalty=2.0)),
                make_request(SamplingParams(temperature=0.0, logprobs=0)),
                make_request(SamplingParams(temperature=0.0))]
    out = Sampler((EOS,), seed=9)(logits, requests)

    first, second, third = out.logprobs
    assert third is None
    assert first is not None and second is not None
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-6)
    values, ids = raw[0].topk(4)
    assert [t for t, _ in first.top] == ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert [v for _, v in first.top] == sorted((v for _, v in first.top), reverse=True)
    assert second.top == [] and second.logprob == pytest.approx(raw[1].max().item(), abs=1e-6)


def test_logprobs_capped_at_vocab() -> None:
    request = make_request(SamplingParams(temperature=0.0, logprobs=20))
    entry = Sampler((EOS,))(torch.tensor([[0.0, 1.0, 2.0]]), [request]).logprobs[0]
    assert entry is not None and [t for t, _ in entry.top] == [2, 1, 0]
    assert sum(math.exp(v) for _, v in entry.top) == pytest.approx(1.0)


# --- distribution -----------------------------------------------------------------------------------


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def test_unseeded_draws_follow_softmax() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -0.5])
    draws = 20000
    tokens = Sampler((EOS,), seed=10)(logits.repeat(draws, 1),
                                       [make_request(SamplingParams(temperature=1.0))] * draws).token_ids
    probs = logits.softmax(dim=-1)
    frequencies = torch.bincount(torch.tensor(tokens), minlength=6).double() / draws
    assert (frequencies - probs.double()).abs().max() < 0.015
    assert chi_square(tokens, probs) < 20.5                             # df 5, p = 0.001


def test_seeded_draws_follow_softmax_across_seeds() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -0.5])
    draws = 5000
    requests = [make_request(SamplingParams(temperature=2.0, seed=seed)) for seed in range(draws)]
    tokens = Sampler((EOS,))(logits.repeat(draws, 1), requests).token_ids
    assert chi_square(tokens, (logits / 2.0).softmax(dim=-1)) < 20.5


def test_logit_bias_allowed_ids_and_bad_words_steer_greedy_but_not_logprobs() -> None:
    logits = logits_from_probs([0.1, 0.5, 0.3, 0.1])
    sampler = Sampler(eos_token_ids=())
    assert sampler(logits, [make_request(SamplingParams(temperature=0, logprobs=1))]).token_ids == [1]
    biased = sampler(logits, [make_request(SamplingParams(temperature=0, logprobs=1, logit_bias={1: -100}))])
    assert biased.token_ids == [2]
    assert biased.logprobs[0].top[0][0] == 1 and biased.logprobs[0].rank == 2       # raw: the model still prefers 1
    assert sampler(logits, [make_request(SamplingParams(temperature=0, logit_bias={3: 5.0}))]).token_ids == [3]
    only = make_request(SamplingParams(temperature=1.0, seed=4, allowed_token_ids=(0, 3)))
    assert all(sampler(logits, [only]).token_ids[0] in (0, 3) for _ in range(20))
    banned = make_request(SamplingParams(temperature=0), output=(2,))
    banned.bad_words_token_ids = ((1,), (2, 2))         # 1 always; 2 when the output ends with 2
    assert sampler(logits, [banned]).token_ids == [0]         # 1 and 2 banned: the first of the rest
    assert sampler(logits, [make_request(SamplingParams(temperature=0))]).token_ids == [1]     # unchanged


def test_banned_by_bad_words_matches_the_output_tail() -> None:
    from kvstrata.worker.logits_processors import banned_by_bad_words
    words = [(7,), (3, 4, 5), (9, 9)]
    assert banned_by_bad_words(words, []) == [7]
    assert banned_by_bad_words(words, [1, 3, 4]) == [7, 5]
    assert banned_by_bad_words(words, [3, 4, 1]) == [7]
    assert banned_by_bad_words(words, [9]) == [7, 9]
