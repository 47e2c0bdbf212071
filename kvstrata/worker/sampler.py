"""`Sampler`: last-position logits -> one token per request, vectorized over the batch.

Its semantics follow vLLM v1's sampler, so clients see the same behaviour. The pipeline, per row, each stage run only on the rows that need it:

    raw logits ──> logprobs (log_softmax of the raw logits, vLLM's default "raw_logprobs")
        │
        ├─ logit_bias, allowed_token_ids, bad_words (logits_processors.py)
        ├─ min_tokens: EOS and stop_token_ids -> -inf until min_tokens outputs exist
        ├─ repetition penalty  (prompt + output tokens; HF/vLLM: l > 0 ? l / r : l * r)
        ├─ presence / frequency penalties (output tokens only; OpenAI: l -= f * count + p * [count > 0])
        │
        ├─ greedy rows ──> argmax
        └─ random rows ──> / temperature ─> top-k ─> top-p ─> min-p ─> softmax ─> argmax(probs / q)

Sampling uses the exponential race: with q ~ Exp(1) per token, argmax(probs / q) is a draw from
probs, so once the noise is drawn a whole batch samples in one op. A request with a seed draws its
noise from a generator seeded with (seed, number of output tokens so far): the draw depends on
nothing else, so the request gets the same tokens whatever shares its batch, in any order, and
after preemption and recompute. Requests without a seed share one sampler-wide generator.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstrata.core.outputs import TokenLogprob
from kvstrata.core.request import Request
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.structured.grammar import GrammarMasker
from kvstrata.worker.logits_processors import apply_token_constraints
from kvstrata.worker.logprobs import token_logprobs

_MASK64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]   # None where the request did not ask (sampling.logprobs is None)


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection on 64-bit ints that spreads nearby inputs far apart."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed for one draw of a seeded request: stateless, so recompute redraws the same."""
    return _mix64((_mix64(seed) + num_output_tokens) & _MASK64)


def _on_rows(x: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`x` with a row-wise `fn` applied to the listed rows only; skips the gather/scatter when all are listed."""
    if len(rows) == x.shape[0]:
        return fn(x)
    index = torch.tensor(rows, device=x.device)
    x[index] = fn(x[index])
    return x


def _token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(R, V) float counts of each token id in each list, built with one scatter."""
    lengths = torch.tensor([len(ids) for ids in token_lists], device=device)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths,
                                   output_size=flat.numel())       # known size: no device sync
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    counts.index_put_((rows, flat), torch.ones_like(flat, dtype=counts.dtype), accumulate=True)
    return counts


def _stop_ids(request: Request, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Token ids that would end the request: what min_tokens must hold back (EOS only without ignore_eos)."""
    eos = () if request.sampling.ignore_eos else eos_token_ids
    return eos + request.sampling.stop_token_ids


def _needs_penalties(request: Request, eos_token_ids: tuple[int, ...]) -> bool:
    p = request.sampling
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or (request.num_output_tokens < p.min_tokens and bool(_stop_ids(request, eos_token_ids))))


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request],
                    eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """min_tokens, repetition, presence and frequency penalties; returns a new (S, V) tensor.

    These change the distribution greedy rows take the argmax of, so they run before the
    greedy/random split; `logits` is left alone because logprobs are read from it.
    """
    out = logits.clone()
    vocab_size = out.shape[1]

    stop_rows, stop_cols = [], []
    for i, request in enumerate(requests):
        if request.num_output_tokens < request.sampling.min_tokens:
            # An id past the vocabulary can never be sampled, so there is nothing to hold back.
            ids = [t for t in _stop_ids(request, eos_token_ids) if t < vocab_size]
            stop_rows += [i] * len(ids)
            stop_cols += ids
    if stop_rows:
        out[torch.tensor(stop_rows, device=out.device), torch.tensor(stop_cols, device=out.device)] = float("-inf")

    rep_rows = [i for i, r in enumerate(requests) if r.sampling.repetition_penalty != 1.0]
    if rep_rows:
        seen = _token_counts([requests[i].token_ids for i in rep_rows], vocab_size, out.device) > 0
        penalty = torch.tensor([requests[i].sampling.repetition_penalty for i in rep_rows],
                               device=out.device)[:, None]                              # (R, 1)

        def repetition(rows: torch.Tensor) -> torch.Tensor:
            return torch.where(seen, torch.where(rows > 0, rows / penalty, rows * penalty), rows)
        out = _on_rows(out, rep_rows, repetition)

    pf_rows = [i for i, r in enumerate(requests)
               if (r.sampling.presence_penalty != 0.0 or r.sampling.frequency_penalty != 0.0)
               and r.num_output_tokens > 0]
    if pf_rows:
        counts = _token_counts([requests[i].output_token_ids for i in pf_rows], vocab_size, out.device)
        presence = torch.tensor([requests[i].sampling.presence_penalty for i in pf_rows], device=out.device)
        frequency = torch.tensor([requests[i].sampling.frequency_penalty for i in pf_rows], device=out.device)
        penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0)          # (R, V)
        out = _on_rows(out, pf_rows, lambda rows: rows - penalty)
    return out


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf all but the top_k largest, then all but the smallest nucleus of mass >= top_p.

    One descending sort serves both cuts. A row opts out with top_k = V and top_p = inf
    (not 1.0, so float error in the cumsum can never drop the tail).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)                         # (R, V)
    ranks = torch.arange(logits.shape[1], device=logits.device)
    sorted_logits.masked_fill_(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs       # 0 for the best token, so it is always kept
    sorted_logits.masked_fill_(mass_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with prob < min_p * max prob; in log space, so no softmax is needed."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]           # (R, 1)
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (HF order) for random rows; returns the final logits, -inf where cut.

    Every row must be non-greedy. Top-k and min-p both keep a prefix of the sorted order, so only
    where top-p sits matters: it measures its nucleus after top-k, as HF and vLLM do.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    out = logits / temperature[:, None]                                                 # (R, V)

    cut_rows = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if cut_rows:
        top_k = torch.tensor([min(params[j].top_k or vocab_size, vocab_size) for j in cut_rows], device=device)
        top_p = torch.tensor([params[j].top_p if params[j].top_p < 1.0 else float("inf") for j in cut_rows],
                             device=device)
        out = _on_rows(out, cut_rows, lambda x: _top_k_top_p(x, top_k, top_p))

    min_p_rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if min_p_rows:
        min_p = torch.tensor([params[j].min_p for j in min_p_rows], device=device)
        out = _on_rows(out, min_p_rows, lambda x: _min_p(x, min_p))
    return out


class Sampler:
    """Picks the next token of every request in a batch. Holds only the unseeded generators.

    Logprobs are those of the raw model distribution (log_softmax of the logits before
    penalties, temperature and filters), as vLLM reports by default: they describe what the
    model thinks, not how this request chose to sample.
    """

    def __init__(self, eos_token_ids: tuple[int, ...], seed: int | None = None,
                 grammars: GrammarMasker | None = None) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = grammars        # masks the rows of requests with structured output; None: none allowed
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}   # unseeded requests draw from these
        self._seeded: dict[torch.device, torch.Generator] = {}   # reseeded for every seeded row

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits: (S, V) float32, row i belongs to requests[i]."""
        params = [r.sampling for r in requests]
        processed = self.process(logits, requests)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            tokens = processed.argmax(dim=-1)                                              # (S,)
        elif len(random_rows) == len(requests):
            tokens = self._sample(processed, requests)
        else:
            tokens = processed.argmax(dim=-1)
            index = torch.tensor(random_rows, device=logits.device)
            tokens[index] = self._sample(processed[index], [requests[i] for i in random_rows])

        token_ids = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if logprob_rows:
            entries = token_logprobs(logits[torch.tensor(logprob_rows, device=logits.device)],
                                     [token_ids[i] for i in logprob_rows], [params[i].logprobs for i in logprob_rows])
            for i, entry in zip(logprob_rows, entries):
                logprobs[i] = entry
        return SamplerOutput(token_ids, logprobs)

    def process(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Penalties, token constraints and grammars: the logits greedy rows take the argmax of and random
        rows filter; `logits` itself is left alone (logprobs are read from it)."""
        assert logits.dim() == 2 and logits.shape[0] == len(requests), "one logits row per request"
        processed = logits
        if any(_needs_penalties(r, self.eos_token_ids) for r in requests):
            processed = apply_penalties(logits, requests, self.eos_token_ids)
        if any(r.constrains_tokens for r in requests):
            processed = apply_token_constraints(processed if processed is not logits else logits.clone(), requests)
        if self.grammars is not None:       # after penalties, before the greedy/random split; raw logprobs stay
            processed = self.grammars.mask(processed, requests, in_place=processed is not logits)
        return processed

    def generator_for(self, request: Request, device: torch.device) -> torch.Generator:
        """The generator one draw of `request` takes its randomness from: the shared one, or for a seeded
        request one seeded with (seed, outputs so far)."""
        if request.sampling.seed is None:
            return self._generator(self._shared, device, self._seed)
        generator = self._generator(self._seeded, device, 0)
        generator.manual_seed(row_seed(request.sampling.seed, request.num_output_tokens))
        return generator

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """One token per row: the exponential race over the filtered probs."""
        probs = apply_filters(logits, [r.sampling for r in requests]).softmax(dim=-1)     # (R, V)
        noise = self._noise(requests, probs.shape[1], probs.device)                       # (R, V)
        return probs.div_(noise).argmax(dim=-1)

    def _noise(self, requests: Sequence[Request], vocab_size: int, device: torch.device) -> torch.Tensor:
        """(R, V) Exp(1) noise; a seeded row's depends only on (seed, output count, V, device)."""
        noise = torch.empty(len(requests), vocab_size, device=device)
        unseeded = [j for j, r in enumerate(requests) if r.sampling.seed is None]
        if unseeded:
            shared = self._generator(self._shared, device, self._seed)
            _on_rows(noise, unseeded, lambda x: x.exponential_(generator=shared))
        for j, request in enumerate(requests):
            if request.sampling.seed is not None:
                noise[j] = torch.empty(vocab_size, device=device).exponential_(
                    generator=self.generator_for(request, device))
        # Exp(1) can round to 0; then a cut token's 0 / 0 would be NaN, which argmax picks.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    @staticmethod
    def _generator(cache: dict[torch.device, torch.Generator], device: torch.device,
                   seed: int | None) -> torch.Generator:
        """One generator per device, made on first use: the logits decide where sampling runs."""
        if device not in cache:
            generator = torch.Generator(device=device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
            cache[device] = generator
        return cache[device]
