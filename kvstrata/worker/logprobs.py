"""Raw logprobs: the log-softmax of the model's logits at a position, for the token that followed
it (sampled, or the prompt's next token) and the top-n, best first."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.core.outputs import TokenLogprob


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top_n: Sequence[int]) -> list[TokenLogprob]:
    """`logits` (L, V), row j the position whose next token is token_ids[j]; top_n[j] alternatives kept."""
    raw = logits.float().log_softmax(dim=-1)                                               # (L, V)
    chosen = torch.tensor(list(token_ids), device=logits.device)
    chosen_logprob = raw.gather(-1, chosen[:, None])                                       # (L, 1)
    ranks = ((raw > chosen_logprob).sum(dim=-1) + 1).tolist()          # 1 + tokens the model liked more
    chosen_logprob = chosen_logprob.squeeze(-1).tolist()
    width = min(max(top_n, default=0), raw.shape[1])
    top_values, top_ids = raw.topk(width, dim=-1)                                          # (L, n), best first
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprob(token_id, chosen_logprob[j], list(zip(top_ids[j][:n], top_values[j][:n])), ranks[j])
            for j, (token_id, n) in enumerate(zip(token_ids, top_n))]
