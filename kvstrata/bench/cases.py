"""Offline cases and their results: stdlib only, so the peers' scripts in other venvs import this
very file (`benchmarks/peers/common.py`) and every engine is timed and reported the same way.

Prompts file: {"cases": [{"name": str, "output_len": int, "repeats": [[[token ids] per prompt] per repeat]}]}
Each repeat has prompts of its own, so no repeat finds the previous one in a prefix cache. The
headline figure is the fastest repeat (on a shared machine the slower ones mostly measure the
neighbours, as in benchmarks/model_step.py); the median is kept beside it.
"""

from __future__ import annotations

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
