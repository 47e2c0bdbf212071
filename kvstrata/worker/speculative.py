"""Verifying a speculative step's drafts against the model, so the output is what decoding one token
at a time would give.

A chunk [t d1 .. dK] yields K + 1 rows of logits: row i scores the token after d_i (row 0, after t).
Row i is processed as plain decoding would process it once d1..di are in the output (`Drafted`):
penalties, min_tokens, logit bias and bad words all see those drafts.

    greedy    accept d_{i+1} while it is row i's argmax, then emit the argmax of the first row that
              disagreed (or of row K, the bonus token): token for token what plain decoding gives.
    sampled   rejection sampling for a deterministic draft (q(d) = 1): accept d_{i+1} with
              probability p_i(d_{i+1}); on a rejection draw from p_i with d_{i+1} taken out and
              renormalised (the residual max(0, p - q)). Each emitted token then follows p exactly.
              A seeded request draws row i from (seed, outputs so far), as plain decoding does.

A request asking for logprobs gets them for every token it takes, the accepted drafts' and the
one sampled after them, read from the raw logits of their rows (each row is the position plain
decoding would score that token at). A request asking for structured output has each row masked by
its grammar after that row's drafts (kvstrata.structured.grammar): a draft the grammar forbids has
no probability at its row, so it is rejected there, and the token sampled in its place obeys the
grammar as plain decoding's would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstrata.core.outputs import TokenLogprob
from kvstrata.core.request import Request
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.worker.logprobs import token_logprobs
from kvstrata.worker.sampler import Sampler, apply_filters


@dataclass(frozen=True)
class Drafted:
    """A request as plain decoding would see it with `drafts` accepted: what the sampler reads."""

    request: Request
    drafts: tuple[int, ...]

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + list(self.drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + list(self.drafts)

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        return self.request.bad_words_token_ids

    @property
    def constrains_tokens(self) -> bool:
        return self.request.constrains_tokens


@dataclass(frozen=True)
class Verdict:
    num_accepted: int      # drafts accepted, in order from the first
    token_id: int          # the token sampled after them
    logprobs: tuple[TokenLogprob, ...] = ()   # of the accepted drafts and the token, if the request asked


def verify(sampler: Sampler, logits: torch.Tensor, requests: Sequence[Request],
           drafts: Sequence[Sequence[int]]) -> list[Verdict]:
    """`logits` (sum of len(d) + 1, V): each request's rows back to back, row i after its first i drafts."""
    views = [Drafted(r, tuple(d[:i])) for r, d in zip(requests, drafts) for i in range(len(d) + 1)]
    assert logits.shape[0] == len(views), "one row per draft plus one per request"
    processed = sampler.process(logits, views)
    argmax = processed.argmax(dim=-1).tolist()
    verdicts, row = [], 0
    for request, draft in zip(requests, drafts):
        rows = slice(row, row + len(draft) + 1)
        if request.sampling.greedy:
            verdicts.append(_greedy(argmax[rows], draft))
        else:
            verdicts.append(_rejection(sampler, processed[rows], views[rows], draft))
        if request.sampling.logprobs is not None:
            verdicts[-1] = _with_logprobs(verdicts[-1], logits[rows], draft, request.sampling.logprobs)
        row = rows.stop
    return verdicts


def _with_logprobs(verdict: Verdict, logits: torch.Tensor, draft: Sequence[int], top_n: int) -> Verdict:
    """`verdict` with the logprobs of the tokens it takes, from its rows' raw `logits` (K + 1, V)."""
    taken = [*draft[:verdict.num_accepted], verdict.token_id]
    entries = token_logprobs(logits[:len(taken)], taken, [top_n] * len(taken))
    return Verdict(verdict.num_accepted, verdict.token_id, tuple(entries))


def _greedy(targets: list[int], draft: Sequence[int]) -> Verdict:
    accepted = next((i for i, token in enumerate(draft) if targets[i] != token), len(draft))
    return Verdict(accepted, targets[accepted])


def _rejection(sampler: Sampler, processed: torch.Tensor, views: Sequence[Drafted], draft: Sequence[int]) -> Verdict:
    """Rejection sampling of `draft` against the rows' target distributions (K + 1, V)."""
    probs = apply_filters(processed, [v.sampling for v in views]).softmax(dim=-1)            # (K + 1, V)
    for i, token in enumerate(draft):
        generator = sampler.generator_for(views[i], probs.device)
        if torch.rand((), generator=generator, device=probs.device) < probs[i, token]:
            continue
        residual = probs[i].clone()
        residual[token] = 0.0
        if not residual.any():          # p(token) rounds to 1: nothing else can be drawn
            continue
        return Verdict(i, _draw(residual, generator))
    return Verdict(len(draft), _draw(probs[len(draft)], sampler.generator_for(views[-1], probs.device)))


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token with probability proportional to `weights` (V,): the exponential race, as the sampler draws."""
    noise = torch.empty_like(weights).exponential_(generator=generator).clamp_min_(torch.finfo(weights.dtype).tiny)
    return int((weights / noise).argmax())
