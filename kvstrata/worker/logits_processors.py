"""What a request lets the model say: `logit_bias`, `allowed_token_ids` and `bad_words`, applied to
the logits before sampling (as vLLM's logits processors are, and like the penalties, after the raw
logprobs were read: logprobs describe the model, not the constraint)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.core.request import Request


def apply_token_constraints(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """`logits` (S, V) with each row's bias added, disallowed and bad-word tokens at -inf (in place)."""
    vocab_size = logits.shape[1]
    for row, request in enumerate(requests):
        params = request.sampling
        if params.logit_bias:
            ids = [t for t in params.logit_bias if t < vocab_size]
            logits[row, ids] += torch.tensor([float(params.logit_bias[t]) for t in ids], device=logits.device)
        if params.allowed_token_ids is not None:
            allowed = torch.tensor([t for t in params.allowed_token_ids if t < vocab_size], device=logits.device)
            kept = logits[row, allowed].clone()
            logits[row].fill_(float("-inf"))
            logits[row, allowed] = kept
        banned = banned_by_bad_words(request.bad_words_token_ids, request.output_token_ids)
        if banned:
            logits[row, [t for t in banned if t < vocab_size]] = float("-inf")
    return logits


def banned_by_bad_words(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word now: each word's last token, where the output ends
    with the tokens before it (a one-token word is always banned)."""
    banned = []
    for word in bad_words:
        head = len(word) - 1
        if head == 0 or (len(output) >= head and list(output[len(output) - head:]) == list(word[:head])):
            banned.append(word[-1])
    return banned
