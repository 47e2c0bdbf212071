"""How to pick tokens and when to stop (`SamplingParams`), and the grammar an output must match
(`GrammarSpec`). Plain data: checked here, compiled by kvstrata.structured."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvstrata.core.errors import RequestRejected

MAX_STOP_STRINGS = 16
MIN_TEMPERATURE = 1e-5
MAX_SAMPLES = 16               # n and best_of: a family's samples share one prefill

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. `source` is the text the client sent (a JSON schema
    serialized, a regex, a JSON list of choices, a Lark or GBNF grammar); `param` names the request
    field it came from, for the 400 that a bad one earns."""

    kind: GrammarKind
    source: str
    param: str = "response_format"

    def __post_init__(self) -> None:
        assert self.kind in GRAMMAR_KINDS, f"unknown grammar kind {self.kind}"

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> GrammarSpec:
        if not isinstance(schema, (dict, bool)):
            raise RequestRejected(f"{param}: a JSON schema must be an object", param)
        return cls("json_schema", json.dumps(schema), param)

    @classmethod
    def choice(cls, choices: Any, param: str) -> GrammarSpec:
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise RequestRejected(f"{param}: choices must be a non-empty list of non-empty strings", param)
        return cls("choice", json.dumps(choices), param)


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
    structured: GrammarSpec | None = None    # the grammar the output must match
    # What the model may say, applied to the logits with the penalties (logprobs stay the raw ones):
    logit_bias: Mapping[int, float] | None = None      # token id -> added to its logit; -100 bans it
    allowed_token_ids: tuple[int, ...] | None = None   # only these may be sampled
    bad_words: tuple[str, ...] = ()                    # never completed, whichever way they tokenize
    # What the caller gets back:
    prompt_logprobs: int | None = None     # top-n logprobs of every prompt token after the first
    truncate_prompt_tokens: int | None = None          # keep only the prompt's last N tokens
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

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
        _require(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                 f"prompt_logprobs must be between 0 and 20, not {self.prompt_logprobs}")
        _require(all(isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and -100 <= b <= 100
                     for t, b in (self.logit_bias or {}).items()),
                 "logit_bias maps token ids to biases between -100 and 100")
        _require(self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0 and all(
            isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids must be a non-empty list of token ids")
        _require(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words must be non-empty strings")
        _require(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
                 f"truncate_prompt_tokens must be a positive integer, not {self.truncate_prompt_tokens}")
        if self.structured is not None:      # its grammar is compiled (or refused) by kvstrata.structured
            _require(not self.ignore_eos and self.min_tokens == 0,
                     "structured output ends where its grammar ends: ignore_eos and min_tokens are not allowed with it")
        return self

    def for_sample(self, index: int) -> SamplingParams:
        """One sample's parameters: its own seed stream (seed + index, as vLLM), and the sampled
        token's logprob when best_of must rank the samples by it."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        logprobs = 0 if self.logprobs is None and self.num_samples > self.n else self.logprobs
        return dataclasses.replace(self, seed=seed, logprobs=logprobs, n=1, best_of=None)
