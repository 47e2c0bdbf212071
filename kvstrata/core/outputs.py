"""What the engine hands its callers: one step's output per request, with its logprobs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvstrata.core.timeline import RequestTimeline


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]   # (token id, logprob) of the most likely tokens, best first
    rank: int = 1                  # 1 + how many tokens the model thought likelier


@dataclass(frozen=True)
class HandOff:
    """What a prefill engine hands a decode engine through the shared store (on the final output of a
    request added with `hand_off`): the full blocks before its last prompt token, and how many of them,
    from the first, are in the store. The decode engine loads those and computes the rest."""

    block_hashes: tuple[bytes, ...]     # the full blocks before the last prompt token, in order
    num_stored: int                     # leading blocks whose store writes landed
    wait_seconds: float                 # how long the answer waited for the writes


@dataclass
class RequestOutput:
    """What one step produced for one request, as the engine hands it to callers."""

    request_id: str
    new_token_ids: list[int]
    text: str                      # the detokenized delta, never half a character
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_scheduled_time: float | None = None     # monotonic; when the request was first computed (metrics)
    index: int = 0                 # which sample of its request (n / best_of > 1)
    cumulative_logprob: float | None = None       # of the sampled tokens so far, when they were scored
    # On a request's first output only (None on the others): its prompt, and when asked for, each
    # prompt token's logprob (the first is None: nothing predicts it).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    timeline: RequestTimeline | None = None      # on the last output: where the request's time went
    num_draft_tokens: int = 0      # speculative draft tokens verified so far (OpenAI: accepted + rejected
    num_accepted_draft_tokens: int = 0             # prediction tokens, when the drafts came from a prediction)
    kv_transfer: HandOff | None = None   # on the last output of a request added with hand_off


def best_samples(outputs: list[RequestOutput], n: int) -> list[RequestOutput]:
    """The n samples to return, renumbered 0..n-1: all of them when they are n, else the n of
    highest cumulative logprob (vLLM's best_of rule; the raw logprobs of the sampled tokens)."""
    if len(outputs) == n:
        return outputs
    ranked = sorted(outputs, key=lambda out: -(out.cumulative_logprob or 0.0))[:n]
    return [dataclasses.replace(out, index=index) for index, out in enumerate(ranked)]
