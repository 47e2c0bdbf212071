"""Verification of draft tokens (kvstrata.worker.speculative): greedy verification picks exactly what
decoding one token at a time picks, penalties and min_tokens included; rejection sampling keeps the
target distribution (chi-square over many draws on a small vocabulary)."""

import pytest
import torch

from kvstrata.core.request import Request
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.worker.sampler import Sampler
from kvstrata.worker.speculative import verify
from tests.kvcache.fakes import HASHER

CHI2_99_9 = {5: 20.515}       # chi-square critical values at p = 0.001, by degrees of freedom


def request(**sampling) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=32, **sampling).validate(), HASHER)


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.8, "presence_penalty": 1.0, "frequency_penalty": 0.5},
    {"temperature": 0.0, "min_tokens": 3, "stop_token_ids": (4, 9)},
], ids=["plain", "penalties", "min_tokens"])
@pytest.mark.parametrize("wrong_at", [0, 1, 3, None])
def test_greedy_verification_picks_what_decoding_one_token_at_a_time_picks(sampling, wrong_at):
    torch.manual_seed(3)
    logits = torch.randn(5, 12)
    logits[:, [4, 9]] += 3.0                     # stop tokens the model likes: min_tokens must hold them back
    logits[:, 2] += 2.0                          # a token the prompt holds: the penalties push it down
    sampler = Sampler(eos_token_ids=(11,))
    plain = request(**sampling)                  # decoded one token at a time, the reference
    path = []
    for row in range(5):
        token = sampler(logits[row:row + 1], [plain]).token_ids[0]
        path.append(token)
        plain.append_output(token)
    drafts = path[:4]
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % 12
    verdict, = verify(sampler, logits, [request(**sampling)], [drafts])
    accepted = 4 if wrong_at is None else wrong_at
    assert (verdict.num_accepted, verdict.token_id) == (accepted, path[accepted])


def draws(logits: torch.Tensor, draft: list[int], n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """The first and (where the first was the draft's) second token emitted, over n verifications."""
    sampler = Sampler(eos_token_ids=(), seed=seed)
    req = request(temperature=1.0)
    firsts, seconds = [], []
    for _ in range(n):
        verdict, = verify(sampler, logits, [req], [draft])
        emitted = draft[:verdict.num_accepted] + [verdict.token_id]
        firsts.append(emitted[0])
        if len(emitted) > 1:
            seconds.append(emitted[1])
    return firsts, seconds


def chi_square(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", [[1], [4], [1, 2]], ids=["likely", "unlikely", "two"])
def test_rejection_sampling_keeps_the_target_distribution(draft):
    logits = torch.tensor([[0.5, 1.5, 0.0, -0.5, -1.0, 0.8],
                           [1.0, -1.0, 1.2, 0.3, 0.0, -0.3],
                           [0.2, 0.1, -0.4, 0.9, 0.0, 0.0]])[:len(draft) + 1]
    probs = logits.softmax(dim=-1)
    firsts, seconds = draws(logits, draft, 6000)
    assert chi_square(firsts, probs[0]) < CHI2_99_9[5]
    assert len(seconds) > 100 and chi_square(seconds, probs[1]) < CHI2_99_9[5]   # given the first was draft[0]


def test_the_chi_square_bound_catches_a_wrong_sampler():
    """The test above can fail: always accepting the draft is far from the target."""
    logits = torch.tensor([[0.5, 1.5, 0.0, -0.5, -1.0, 0.8], [1.0, -1.0, 1.2, 0.3, 0.0, -0.3]])
    probs = logits.softmax(dim=-1)
    assert chi_square([1] * 6000, probs[0]) > CHI2_99_9[5]


def test_seeded_verification_repeats_itself():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    runs = [[verify(Sampler(eos_token_ids=(), seed=s), logits, [request(temperature=0.9, seed=7)], [[3, 8, 1]])[0]
             for _ in range(5)] for s in (1, 2)]
    assert runs[0] == runs[1]                    # the request's seed decides, not the sampler's
