"""A request's parameters and its token ledger.

`Request` is the one record the scheduler, the tier manager and the runner share:
its token ids (prompt then output), how many of them have KV computed, and the
hashes of its full blocks, extended as tokens arrive. It holds no block ids;
the tier manager owns those.

    token_ids:   [ prompt ............................ | output ....... ]
                  <------- num_computed_tokens ------->  <- to compute ->
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.hashing import BlockHash, BlockHasher

if TYPE_CHECKING:
    from kvstrata.structured import GrammarSpec

MAX_STOP_STRINGS = 16
MIN_TEMPERATURE = 1e-5
MAX_SAMPLES = 16               # n and best_of: a family's samples share one prefill


class RequestRejected(ValueError):
    """A request that can never run, and which of its inputs the caller should change: "prompt"
    (or its messages) or "max_tokens". Raised before anything is queued."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


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


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow the OpenAI API."""

    max_tokens: int | None = 16    # None: up to the context length (the engine resolves it)
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None    # top-n logprobs per output token; 0 = the sampled token's only
    n: int = 1                     # completions returned
    best_of: int | None = None     # completions sampled (None: n); the n of highest cumulative logprob return
    structured: GrammarSpec | None = None    # the grammar the output must match (structured.py)

    @property
    def num_samples(self) -> int:
        """Samples to run: best_of, or n. More than one makes a family sharing one prefill."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 scale logits past float32 range, so they count as greedy too."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    def validate(self) -> SamplingParams:
        _require(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                 f"max_tokens must be a positive integer, not {self.max_tokens!r}")
        _require(0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
                 f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), not {self.min_tokens}")
        _require(math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0,
                 f"temperature must be between 0 and 100, not {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], not {self.top_p}")
        _require(self.top_k >= 0, f"top_k must be 0 (off) or positive, not {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], not {self.min_p}")
        _require(0.0 < self.repetition_penalty <= 10.0,
                 f"repetition_penalty must be in (0, 10], not {self.repetition_penalty}")
        _require(-2.0 <= self.presence_penalty <= 2.0,
                 f"presence_penalty must be in [-2, 2], not {self.presence_penalty}")
        _require(-2.0 <= self.frequency_penalty <= 2.0,
                 f"frequency_penalty must be in [-2, 2], not {self.frequency_penalty}")
        _require(self.seed is None or 0 <= self.seed < 2**63, "seed must be a non-negative 64-bit integer")
        _require(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids must be non-negative integers")
        _require(self.logprobs is None or 0 <= self.logprobs <= 20,
                 f"logprobs must be between 0 and 20, not {self.logprobs}")
        _require(isinstance(self.n, int) and 1 <= self.n <= MAX_SAMPLES,
                 f"n must be between 1 and {MAX_SAMPLES}, not {self.n}")
        _require(self.best_of is None or (isinstance(self.best_of, int) and self.n <= self.best_of <= MAX_SAMPLES),
                 f"best_of must be between n ({self.n}) and {MAX_SAMPLES}, not {self.best_of}")
        if self.structured is not None:
            self.structured.grammar()      # a grammar the library rejects: RequestRejected, nothing queued
            _require(not self.ignore_eos and self.min_tokens == 0,
                     "structured output ends where its grammar ends: ignore_eos and min_tokens are not allowed with it")
        return self

    def for_sample(self, index: int) -> SamplingParams:
        """One sample's parameters: its own seed stream (seed + index, as vLLM), and the sampled
        token's logprob when best_of must rank the samples by it."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        logprobs = 0 if self.logprobs is None and self.num_samples > self.n else self.logprobs
        return dataclasses.replace(self, seed=seed, logprobs=logprobs, n=1, best_of=None)


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
    family: SampleFamily | None = None              # the samples of one request that share its prefill
    sample_index: int = 0

    def __post_init__(self) -> None:
        _require(len(self.prompt_token_ids) >= 1, "the prompt must hold at least one token")
        assert self.sampling.max_tokens is not None, "resolve max_tokens before building a Request"
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.hasher.extend(self.block_hashes, self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

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

    def append_output(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.hasher.extend(self.block_hashes, self.token_ids)


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


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]   # (token id, logprob) of the most likely tokens, best first


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


def best_samples(outputs: list[RequestOutput], n: int) -> list[RequestOutput]:
    """The n samples to return, renumbered 0..n-1: all of them when they are n, else the n of
    highest cumulative logprob (vLLM's best_of rule; the raw logprobs of the sampled tokens)."""
    if len(outputs) == n:
        return outputs
    ranked = sorted(outputs, key=lambda out: -(out.cumulative_logprob or 0.0))[:n]
    return [dataclasses.replace(out, index=index) for index, out in enumerate(ranked)]
