"""Draft tokens for speculative decoding, taken from text the request already has: no draft model.

ngram (prompt lookup; vLLM's `method: ngram`, llama.cpp's lookup decoding): the request's latest n
tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`, are looked for earlier in its prompt
and output; the tokens that followed their most recent occurrence are the draft.

    context:  ... a b c d e ... x y a b c   <- latest n = 3 tokens, found earlier
                        ^^^^^ draft (K = 3): the tokens after that occurrence

prediction (OpenAI predicted outputs): the client sent the text it expects. While the output copies
it, the draft is the prediction's next tokens; after an edit, the tokens after the occurrence of the
output's latest n tokens nearest to where a verbatim copy would stand; where the prediction has no
such occurrence, by n-gram lookup in the request's prompt and output (an edit's new names recur there).

Proposals are pure functions of token lists: a proposal changes nothing, and a wrong one only costs
its verification. `judge` keeps each request's recent acceptance, and pauses its drafts while they do
not pay for their rows; `worth_drafting` stops a step's drafts at the first that would not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvstrata.core.config import SpeculativeConfig
from kvstrata.core.request import Request

PREDICTION_NGRAM = (2, 8)     # n-gram lengths that re-align the output with a prediction after an edit
PREDICTION_LOOKAHEAD = 8      # drafts per step from a prediction without --speculative-config: most are accepted
# Whether drafts pay. A draft token adds a row to the step every running request waits for, and saves its
# request a step when accepted: it pays when its chance of acceptance beats `break_even`, the share of a
# decode step's time per decoding request one more row costs (kvstrata.scheduler.step_cost; a single stream,
# bf16, 2-core Zen 5 EPYC: 0.8 ms a row against an 18 ms step). Until the engine has measured its steps,
# DEFAULT_BREAK_EVEN: one fp32 stream rewriting code (K = 4) ran 1.03x plain decoding at 26% accepted.
DEFAULT_BREAK_EVEN = 0.25
# No drafts at all in a step whose break-even is above this (a large batch: a 2-core Zen 5 EPYC's bf16
# step of 32 decodes breaks even at ~0.75): few requests' drafts are accepted that often, and the probes
# of requests pausing after failed judgements would cost every request more than they find.
MAX_BREAK_EVEN = 0.5          # (a prediction drafts whatever the step's break-even: the client sent it, and one
                              # noisy fit above 0.5 on a single stream cost a benchmark run 220 -> 372 steps)
RECENT = 0.75                 # weight of a request's earlier drafts at each verification: judged on its last few
JUDGED_AFTER = 3              # verifications before a request's drafts are judged (and again after a pause)
FIRST_PAUSE = 32              # output tokens a request that failed the judgement goes without drafts; each
                              # failure after doubles it: its text may turn to copying later (a code edit
                              # quotes, then paraphrases, then quotes again), but a probe costs every request


def may_draft(request: Request) -> bool:
    """Whether the request proposes drafts this step (not while paused after drafts that did not pay)."""
    return request.num_output_tokens >= request.draft_history.paused_until


def worth_drafting(request: Request, break_even: float, most: int) -> int:
    """How many of up to `most` drafts pay. The j-th draft of a step is accepted only if the j - 1 before
    it were: with each accepted with the request's recent chance a (accepted drafts per accepted or
    rejecting one), the j-th pays while a^j > `break_even`. So a stream (break-even ~0.05) drafts its K,
    while at batch 30 (~0.48) a request accepting 80% drafts 3 (at batch 32, K = 8 ran 0.96x plain
    decoding where K = 4 ran 1.07x). Predictions and requests not yet judged draft `most`."""
    history = request.draft_history
    if request.prediction_token_ids or history.verifications < JUDGED_AFTER or break_even <= 0.0:
        return most
    tries = history.accepted + history.rejections
    chance = history.accepted / tries if tries > 0 else 0.0
    if chance >= 1.0:
        return most
    if chance <= break_even:
        return 0
    return min(most, int(math.log(break_even) / math.log(chance)))


def judge(request: Request, drafted: int, accepted: int, break_even: float) -> None:
    """Record one verification; pause a request whose recent drafts were accepted less than
    `break_even` of the time. A prediction is never paused: the client sent it, and its drafts
    re-align after an edit."""
    history = request.draft_history
    history.verifications += 1
    history.drafted = history.drafted * RECENT + drafted
    history.accepted = history.accepted * RECENT + accepted
    history.rejections = history.rejections * RECENT + (accepted < drafted)
    if request.prediction_token_ids or history.verifications < JUDGED_AFTER:
        return
    if history.accepted >= break_even * history.drafted:
        history.next_pause = 0
        return
    pause = history.next_pause or FIRST_PAUSE
    history.paused_until = request.num_output_tokens + pause
    history.next_pause = 2 * pause
    history.drafted = history.accepted = history.rejections = 0.0
    history.verifications = 0


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
        """At most `k` draft tokens to follow the request's tokens (possibly none). A request with a
        prediction drafts from it, and where its output has left the prediction behind, by n-gram
        lookup in its own prompt and output (an edit's new names recur there, not in the prediction)."""
        if request.prediction_token_ids:
            return prediction_draft(request.prediction_token_ids, request.output_token_ids, k) \
                or ngram_draft(request.token_ids, k, *PREDICTION_NGRAM)
        return ngram_draft(request.token_ids, k, self.prompt_lookup_min, self.prompt_lookup_max)
