"""Offline cases and their results: stdlib only, so the peers' scripts in other venvs import this
very file (`benchmarks/peers/common.py`) and every engine is timed and reported the same way.

Prompts file: {"cases": [{"name": str, "output_len": int, "repeats": [[[token ids] per prompt] per repeat],
"predictions": the same shape or null}]}
Each repeat has prompts of its own, so no repeat finds the previous one in a prefix cache. A case
with predictions (OpenAI predicted outputs, `kvstrata.bench.grounded`) sends each prompt's with it. The
headline figure is the fastest repeat (on a shared machine the slower ones mostly measure the
neighbours, as in benchmarks/model_step.py); the median is kept beside it.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstrata.bench.quiet import wait_quiet


@dataclass(frozen=True)
class OfflineCase:
    name: str
    output_len: int
    repeats: list[list[list[int]]]     # repeat -> prompt -> token ids
    predictions: list[list[list[int]]] | None = None    # the same shape: each prompt's predicted output


@dataclass
class Speculation:
    """Speculative decoding of one run, in vLLM's terms: a draft is one verification of one
    request's draft tokens (its spec_decode_num_drafts), accepted tokens are draft tokens the model
    agreed with."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields, the bonus token included (vLLM's mean acceptance length)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def describe(self) -> str:
        return (f"acceptance rate {self.acceptance_rate:.0%} ({self.accepted_tokens} of {self.draft_tokens} draft "
                f"tokens), mean acceptance length {self.mean_acceptance_length:.2f} over {self.drafts} verifications")


@dataclass
class CaseResult:
    name: str
    num_prompts: int
    input_len: float                    # mean prompt tokens
    output_len: int
    elapsed_s: list[float]              # one per repeat, submission to last token
    cpu_busy: list[float]               # share of the cores others used just before each repeat
    output_tok_s: float                 # output tokens / fastest repeat
    median_output_tok_s: float          # output tokens / median repeat
    total_tok_s: float                  # (prompt + output tokens) / fastest repeat
    steps: int | None = None            # engine steps of the fastest repeat (kvstrata only)
    weight_gb_s: float | None = None    # weight bytes x steps / fastest repeat (kvstrata only)
    speculation: Speculation | None = None    # drafts of the fastest repeat, where the engine counts them
    output_digests: list[str] | None = None   # per repeat, `digest` of its outputs: equal digests, equal tokens


def digest(outputs: list[list[int]]) -> str:
    """A short fingerprint of a repeat's output token ids, to compare runs that must agree (greedy)."""
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def write_cases(path: Path, cases: list[OfflineCase]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cases": [asdict(c) for c in cases]}))


def read_cases(path: str | Path) -> list[OfflineCase]:
    return [OfflineCase(**c) for c in json.loads(Path(path).read_text())["cases"]]


def time_case(case: OfflineCase, generate: Callable[[list[list[int]]], object], patience: float) -> CaseResult:
    """Time `generate(prompts)` on every repeat of `case`, each after waiting for a quiet machine."""
    elapsed, busy = [], []
    for prompts in case.repeats:
        busy.append(wait_quiet(patience, case.name))
        start = time.perf_counter()
        generate(prompts)
        elapsed.append(time.perf_counter() - start)
    prompts = case.repeats[0]
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = len(prompts) * case.output_len
    best = min(elapsed)
    return CaseResult(case.name, len(prompts), prompt_tokens / len(prompts), case.output_len, elapsed, busy,
                      output_tokens / best, output_tokens / statistics.median(elapsed),
                      (prompt_tokens + output_tokens) / best)
