"""Figures out of runs: per-target summaries, ratios, a text table, JSON and a PNG.

A target's summary pools the requests of all its repeats (latency percentiles over every request,
throughput as tokens over the summed run time). Ratios are base / other for every figure: above 1
means the base is higher (better for throughput, worse for latency).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstrata.bench.loadgen import RunResult
from kvstrata.bench.metrics import RunMetrics
from kvstrata.core.machine import machine

ROWS: tuple[tuple[str, str], ...] = (
    ("completed", "completed requests"), ("failed", "failed requests"), ("duration_s", "run time (s)"),
    ("request_throughput", "requests/s"), ("goodput", "goodput (requests/s in SLO)"),
    ("output_throughput", "output tok/s"), ("total_token_throughput", "total tok/s"),
    ("mean_prompt_tokens", "prompt tokens (mean)"), ("mean_output_tokens", "output tokens (mean)"),
    ("cached_fraction", "cached prompt fraction"),
)
LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency"))


def summarize(runs: Sequence[RunResult], slo: dict[str, float]) -> dict[str, RunMetrics]:
    """One RunMetrics per label over all its repeats, in the order labels first appear."""
    labels = list(dict.fromkeys(r.label for r in runs))
    return {label: RunMetrics.of([x for r in runs if r.label == label for x in r.results],
                                 sum(r.duration for r in runs if r.label == label), slo) for label in labels}


def flat(metrics: RunMetrics) -> dict[str, float | None]:
    """'ttft_ms.p99' -> value: every figure of a summary under one key."""
    out: dict[str, float | None] = {}
    for key, value in dataclasses.asdict(metrics).items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items() if k != "count"})
        else:
            out[key] = value
    return out


def ratios(summary: dict[str, RunMetrics]) -> dict[str, dict[str, float | None]]:
    """{'base/other': {figure: base / other}} for every non-base label."""
    labels = list(summary)
    base = flat(summary[labels[0]])
    out = {}
    for other in labels[1:]:
        theirs = flat(summary[other])
        out[f"{labels[0]}/{other}"] = {k: _ratio(base[k], theirs[k]) for k in base}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def table(summary: dict[str, RunMetrics]) -> str:
    """A plain-text table: one column per target, then one per ratio."""
    rel = ratios(summary)
    header = ["figure", *summary, *rel]
    rows = []
    flats = {label: flat(m) for label, m in summary.items()}
    keys = [(k, name) for k, name in ROWS] + [
        (f"{k}.{stat}", f"{name} {stat} (ms)") for k, name in LATENCIES for stat in ("mean", "p50", "p90", "p99")]
    for key, name in keys:
        rows.append([name, *(_fmt(flats[label][key]) for label in summary), *(_fmt(r[key]) for r in rel.values())])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    return "\n".join(lines)


def to_json(runs: Sequence[RunResult], summary: dict[str, RunMetrics], config: dict[str, Any]) -> dict[str, Any]:
    def request(r) -> dict:
        return {"start": r.start, "ok": r.ok, "ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el,
                "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                "cached_tokens": r.cached_tokens, "error": r.error or None}
    return {
        "config": config, "machine": machine().as_dict(),
        "summary": {label: dataclasses.asdict(m) for label, m in summary.items()},
        "ratios": ratios(summary),
        "runs": [{"label": r.label, "repeat": r.repeat, "seed": r.seed, "duration_s": r.duration,
                  "load_before": r.load_before, "load_after": r.load_after, "cpu_busy_before": r.cpu_busy_before,
                  "requests": [request(x) for x in r.results]} for r in runs],
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(data), indent=1, allow_nan=False) + "\n")


def clean(value: Any) -> Any:
    """NaN -> None and infinity -> "inf", recursively, so the JSON is valid for every reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def plot(path: Path, runs: Sequence[RunResult], summary: dict[str, RunMetrics], title: str) -> None:
    """Latency CDFs (TTFT, TPOT, end-to-end) per target and a throughput bar chart, in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, pick) in zip(axes.flat, (("TTFT (ms)", lambda r: r.ttft), ("TPOT (ms)", lambda r: r.tpot),
                                            ("end-to-end latency (ms)", lambda r: r.e2el))):
        for label in summary:
            values = sorted(1000 * v for run in runs if run.label == label for r in run.results
                            if r.ok and (v := pick(r)) is not None)
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes.flat[3]
    labels = list(summary)
    bars = ax.bar(labels, [summary[label].output_throughput for label in labels])
    ax.bar_label(bars, [f"{summary[label].output_throughput:.1f} out\n{summary[label].total_token_throughput:.0f} total"
                        for label in labels])
    ax.set_ylabel("output tokens / s")
    ax.margins(y=0.2)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
