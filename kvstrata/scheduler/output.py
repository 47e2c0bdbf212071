"""What the scheduler hands the model runner for one step: each request's chunk of tokens and its blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.core.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one request to compute in this step, and where their KV lives."""

    request: Request
    start: int                 # position of the first token (== tokens already in KV)
    token_ids: list[int]
    block_ids: list[int]       # the request's whole block table
    sample: bool               # the chunk reaches the last token: its logits pick the next one
    forks: tuple[Request, ...] = ()   # samples of the request's family that fork from these logits
    draft_token_ids: tuple[int, ...] = ()   # the last len() of token_ids: drafts to verify (not in the ledger)
    group_block_ids: list[list[int]] = ()   # with KV groups: the tables of groups 1.. (-1: a page let go)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
