"""Draft tokens for speculative decoding, taken from text the request already has: no draft model.

ngram (prompt lookup; vLLM's `method: ngram`, llama.cpp's lookup decoding): the request's latest n
tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`, are looked for earlier in its prompt
and output; the tokens that followed their most recent occurrence are the draft.

    context:  ... a b c d e ... x y a b c   <- latest n = 3 tokens, found earlier
                        ^^^^^ draft (K = 3): the tokens after that occurrence

prediction (OpenAI predicted outputs): the client sent the text it expects. While the output copies
it, the draft is the prediction's next tokens; after an edit, the tokens after the occurrence of the
output's latest n tokens nearest to where a verbatim copy would stand.

Pure functions of token lists: a proposal changes nothing, and a wrong one only costs its verification.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvstrata.core.config import SpeculativeConfig
from kvstrata.core.request import Request

PREDICTION_NGRAM = (2, 8)     # n-gram lengths that re-align the output with a prediction after an edit
PREDICTION_LOOKAHEAD = 8      # drafts per step from a prediction without --speculative-config: most are accepted
# An n-gram request whose drafts are accepted less often than this stops speculating: one stream
# rewriting a code prompt (K = 4, 2-core Zen 5 EPYC) ran 1.03x plain decoding at 26% accepted in fp32
# and 1.40x at 30% in bf16, so below a quarter the K extra rows no longer pay for themselves.
MIN_ACCEPTANCE = 0.25
JUDGED_AFTER = 32             # draft tokens verified before a request's acceptance is judged


def still_pays(request: Request) -> bool:
    """Whether a request's drafts so far earn their verification. A prediction always does: the
    client sent it, and its drafts re-align after an edit."""
    return bool(request.prediction_token_ids) or request.num_draft_tokens < JUDGED_AFTER \
        or request.num_accepted_tokens >= MIN_ACCEPTANCE * request.num_draft_tokens


def _continuations(corpus: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """Positions right after each occurrence of `pattern` in `corpus` that some token follows, in order."""
    n = len(pattern)
    if len(corpus) <= n:
        return np.empty(0, dtype=np.int64)
    windows = sliding_window_view(corpus[:-1], n)                 # (L - n, n): occurrences followed by a token
    return np.flatnonzero((windows == pattern).all(axis=1)) + n


def ngram_draft(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest matching suffix.

    The occurrences of the latest `min_n` tokens are found once; each longer suffix keeps those of
    them preceded by its next token, until none is or `max_n` is reached. So a long `max_n` costs a
    few comparisons per surviving occurrence, not one scan of the context per length."""
    context = np.asarray(token_ids, dtype=np.int64)
    if len(context) <= min_n:
        return []
    starts = _continuations(context, context[-min_n:])           # the suffix itself has nothing after it
    n = min_n
    while len(starts) and n < min(max_n, len(context) - 1):
        before = starts - n - 1                                   # the token before each occurrence
        longer = starts[(before >= 0) & (context[np.maximum(before, 0)] == context[-n - 1])]
        if not len(longer):
            break
        starts, n = longer, n + 1
    if not len(starts):
        return []
    return context[starts[-1]:starts[-1] + k].tolist()


def prediction_draft(prediction: Sequence[int], output: Sequence[int], k: int) -> list[int]:
    """Up to `k` tokens of `prediction` expected after `output`."""
    done = len(output)
    if list(prediction[:done]) == list(output):
        return list(prediction[done:done + k])
    predicted, out = np.asarray(prediction, dtype=np.int64), np.asarray(output, dtype=np.int64)
    for n in range(min(PREDICTION_NGRAM[1], done), PREDICTION_NGRAM[0] - 1, -1):
        starts = _continuations(predicted, out[-n:])
        if len(starts):
            start = int(starts[np.abs(starts - done).argmin()])
            return predicted[start:start + k].tolist()
    return []


@dataclass(frozen=True)
class DraftProposer:
    """Proposes a request's drafts: from its prediction if it has one, else by n-gram lookup."""

    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5

    @classmethod
    def from_config(cls, config: SpeculativeConfig | None) -> DraftProposer:
        if config is None:            # only requests with a prediction speculate
            return cls()
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, request: Request, k: int) -> list[int]:
        """At most `k` draft tokens to follow the request's tokens (possibly none)."""
        if request.prediction_token_ids:
            return prediction_draft(request.prediction_token_ids, request.output_token_ids, k)
        return ngram_draft(request.token_ids, k, self.prompt_lookup_min, self.prompt_lookup_max)
