"""A request's token ledger, its status, and the family of samples it may belong to.

`Request` is the one record the scheduler, the tier manager and the runner share:
its token ids (prompt then output), how many of them have KV computed, and the
hashes of its full blocks, extended as tokens arrive. It holds no block ids;
the tier manager owns those.

    token_ids:   [ prompt ............................ | output ....... ]
                  <------- num_computed_tokens ------->  <- to compute ->
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvstrata.core.hashing import BlockHash, BlockHasher
from kvstrata.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is final."""

    WAITING = 0
    PREEMPTED = 1      # waiting again after losing its blocks; resumes before new requests
    LOADING = 2        # blocks committed, waiting for lower-tier loads to land
    RUNNING = 3
    AWAITING_FORK = 4  # a sample of a family: waits for its leader's prefill, then forks from it
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13    # its step raised; everything it held was released

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass
class DraftHistory:
    """A speculating request's recent drafts (decayed sums), by which the scheduler judges whether they
    pay (kvstrata.scheduler.drafts), and the pause it is in when they did not."""

    verifications: int = 0         # of its drafts since it last paused
    drafted: float = 0.0           # draft tokens verified lately
    accepted: float = 0.0          # of them, accepted
    rejections: float = 0.0        # verifications that ended at a rejected draft, lately
    paused_until: int = 0          # no drafts before the request has this many output tokens
    next_pause: int = 0            # output tokens the next pause lasts (0: the first pause's)


@dataclass(frozen=True)
class AdapterRef:
    """The LoRA adapter a request runs under: its name (what the client asked for) and the digest of
    its files (what its blocks are keyed by, through the hasher's root)."""

    name: str
    digest: str


@dataclass(eq=False)
class Request:
    """One generation request. Mutated only by the scheduler (and the engine for stop strings)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    hasher: BlockHasher
    arrival_time: float = 0.0
    priority: int = 0              # lower value is served first
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int = -1    # prompt tokens served from cache at first admission; -1 until admitted
    first_scheduled_time: float | None = None      # monotonic time of the first step that computed it
    num_preemptions: int = 0
    device_hits_only: bool = False  # its next admission takes device hits only (KV groups: a lower tier failed it)
    num_shared_blocks: int = 0     # KV groups: leading blocks a tier held at its first admission, before a group
                                   # lacking its window cut the hit: where its prompt left a prefix sent before
    family: SampleFamily | None = None              # the samples of one request that share its prefill
    sample_index: int = 0
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()   # sampling.bad_words as the tokenizer spells them
    # Speculative decoding: at most this many draft tokens verified per step (0: none); drafted from
    # `prediction_token_ids` (OpenAI predicted outputs) when given, else from the prompt and output.
    num_lookahead_tokens: int = 0
    prediction_token_ids: tuple[int, ...] = ()
    num_draft_tokens: int = 0      # draft tokens verified so far
    num_accepted_tokens: int = 0   # of them, accepted
    draft_history: DraftHistory = field(default_factory=DraftHistory)
    adapter: AdapterRef | None = None              # None: the base model

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must hold at least one token")
        assert self.sampling.max_tokens is not None, "resolve max_tokens before building a Request"
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.hasher.extend(self.block_hashes, self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def samples(self) -> list[Request]:
        """Every sample of its family (leader first), or just itself when it has none."""
        return self.family.samples if self.family is not None else [self]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def max_total_tokens(self) -> int:
        """The longest this request can grow: prompt plus max_tokens."""
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def constrains_tokens(self) -> bool:
        """Whether a logits processor (bias, allowed ids, bad words) applies before sampling."""
        params = self.sampling
        return bool(params.logit_bias) or params.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt position's logits are needed, so no prompt block may come from a cache (vLLM's rule)."""
        return self.sampling.prompt_logprobs is not None

    def append_output(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.hasher.extend(self.block_hashes, self.token_ids)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first `num_output_tokens` outputs: a stop string ended a finished request inside
        the tokens one speculative step appended, and those after it were never generated."""
        assert self.is_finished, f"{self.request_id} is truncated while it still holds blocks"
        del self.token_ids[self.num_prompt_tokens + num_output_tokens:]
        del self.block_hashes[self.num_tokens // self.hasher.block_size:]


@dataclass(eq=False)
class SampleFamily:
    """The samples of one request (n or best_of > 1), which compute its prompt once.

    The leader (sample 0) is admitted, with room for the whole family, and prefills the prompt;
    the others wait in AWAITING_FORK. The step that samples the leader's first token samples
    theirs from the same logits, and each forks: it holds the leader's full prompt blocks (one
    more reference each) and a private copy of the partly filled last one. From then on each
    sample is a request of its own that shares those blocks.

        leader:    [ p0 p1 p2 p3 | p4 p5 p6 p7 | p8 p9 t0 .. ]
        sample 1:  [ shared      | shared      | p8 p9 u0 .. ]   (last block copied at the fork)
    """

    family_id: str
    samples: list[Request]
    forked: bool = False

    @property
    def leader(self) -> Request:
        return self.samples[0]

    @property
    def pending(self) -> list[Request]:
        """The samples still waiting to fork (none once the fork happened)."""
        return [] if self.forked else [s for s in self.samples[1:] if not s.is_finished]
