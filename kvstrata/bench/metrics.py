"""Per-request results -> run metrics: latency summaries, throughput, goodput, cached tokens.

Definitions follow `vllm bench serve`: TTFT is send -> first streamed chunk; ITL the gaps between
chunks; TPOT (e2e - TTFT) / (output tokens - 1), per request; goodput the completed requests that
meet every SLO, per second of the run (DistServe's measure: the load a server carries within its SLO,
which throughput alone overstates when the tail misses it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What the client saw of one request (seconds)."""

    ok: bool
    prompt_tokens: int                   # from usage, else the length sent
    output_tokens: int = 0               # from usage, else the number of chunks with text
    cached_tokens: int | None = None     # usage.prompt_tokens_details.cached_tokens, if the server says
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0                   # seconds from the start of the run
    error: str = ""
    request_id: str | None = None        # the response's `id` (cmpl-...), for the server's /v1/timelines

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass(frozen=True)
class Summary:
    """Milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Summary:
        if not seconds:
            return cls(math.nan, math.nan, math.nan, math.nan, 0)
        ms = sorted(s * 1000.0 for s in seconds)
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(sum(ms) / len(ms), p50, p90, p99, len(ms))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on already sorted values."""
    if not sorted_values:
        return math.nan
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500,tpot=50' (milliseconds) -> {'ttft': 0.5, 'tpot': 0.05} (seconds)."""
    slo: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        name, _, value = part.partition("=")
        name = name.strip().lower()
        if name not in SLO_METRICS or not value:
            raise ValueError(f"SLO {part!r}: write name=milliseconds with name one of {', '.join(SLO_METRICS)}")
        slo[name] = float(value) / 1000.0
    return slo


def meets_slo(result: RequestResult, slo: dict[str, float]) -> bool:
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2el}
    return result.ok and all(values[name] <= limit for name, limit in slo.items())


@dataclass(frozen=True)
class RunMetrics:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float        # completed requests / s
    goodput: float                   # completed requests meeting the SLO / s (all completed without SLO)
    slo_fraction: float | None       # share of the requests sent that met every SLO; None without an SLO
    output_throughput: float         # output tokens / s
    total_token_throughput: float    # (prompt + output tokens) / s
    mean_prompt_tokens: float
    mean_output_tokens: float
    cached_fraction: float | None    # cached / prompt tokens over requests that reported usage
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2el_ms: Summary

    @classmethod
    def of(cls, results: Sequence[RequestResult], duration: float, slo: dict[str, float]) -> RunMetrics:
        done = [r for r in results if r.ok]
        prompt = sum(r.prompt_tokens for r in done)
        output = sum(r.output_tokens for r in done)
        reported = [r for r in done if r.cached_tokens is not None]
        reported_prompt = sum(r.prompt_tokens for r in reported)
        duration = max(duration, 1e-9)
        good = sum(meets_slo(r, slo) for r in done)
        return cls(
            completed=len(done), failed=len(results) - len(done), duration_s=duration,
            request_throughput=len(done) / duration,
            goodput=good / duration, slo_fraction=(good / len(results) if results else math.nan) if slo else None,
            output_throughput=output / duration, total_token_throughput=(prompt + output) / duration,
            mean_prompt_tokens=prompt / len(done) if done else math.nan,
            mean_output_tokens=output / len(done) if done else math.nan,
            cached_fraction=sum(r.cached_tokens for r in reported) / reported_prompt if reported_prompt else None,
            ttft_ms=Summary.of([r.ttft for r in done]),
            tpot_ms=Summary.of([t for r in done if (t := r.tpot) is not None]),
            itl_ms=Summary.of([gap for r in done for gap in r.itl]),
            e2el_ms=Summary.of([r.e2el for r in done]),
        )
