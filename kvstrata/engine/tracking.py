"""The engine's side of each request beside its ledger (detokenizer, logprobs, timeline), the last outputs of
handed-off requests held for their store writes, and a request's outputs combined into one (LLMEngine.generate)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvstrata.core.hashing import BlockHash
from kvstrata.core.outputs import RequestOutput, TokenLogprob
from kvstrata.core.request import Request
from kvstrata.core.timeline import RequestTimeline
from kvstrata.engine.detokenizer import IncrementalDetokenizer


@dataclass
class Tracked:
    """Engine-side state of one request (one sample of a family) beside its ledger."""

    request: Request
    detokenizer: IncrementalDetokenizer
    family_id: str                     # the id the caller knows (a family's samples share it)
    show_logprobs: bool                # the caller asked (best_of also scores the samples that did not)
    prompt_logprobs: list[TokenLogprob | None] | None = None   # shared by a family's samples; [0] is None
    timeline: RequestTimeline | None = None     # where its time went (kvstrata.core.timeline)
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    reported: bool = False             # an output has gone out (prompt logprobs ride on the first)
    hand_off: bool = False             # a prefill engine's request: its blocks go to the store, then it answers


@dataclass
class HeldHandOff:
    """The last output of a handed-off request, held until the store writes of its blocks settle."""

    output: RequestOutput
    hashes: list[BlockHash]
    since: float


def combine(parts: list[RequestOutput]) -> RequestOutput:
    """One request's outputs as one: all its tokens, text and logprobs; the first's prompt, the last's state."""
    return dataclasses.replace(parts[-1], new_token_ids=[t for p in parts for t in p.new_token_ids],
                               text="".join(p.text for p in parts), logprobs=[lp for p in parts for lp in p.logprobs],
                               prompt_token_ids=parts[0].prompt_token_ids, prompt_logprobs=parts[0].prompt_logprobs)
