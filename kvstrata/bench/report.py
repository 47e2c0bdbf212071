"""Figures out of runs: per-target summaries, ratios, a text table, the headline, JSON and PNGs.

A target's summary pools the requests of all its repeats (latency percentiles over every request,
throughput as tokens over the summed run time). Ratios are base / other for every figure: above 1
means the base is higher (better for throughput, worse for latency). The headline is throughput
beside goodput (the requests/s that met every SLO), since a server can raise its throughput while
its tail misses the SLO. A sweep (several request rates) adds a summary per rate and a PNG of the p99
latencies against the rate.
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
from kvstrata.bench.tails import Tails
from kvstrata.core.machine import machine

ROWS: tuple[tuple[str, str], ...] = (
    ("completed", "completed requests"), ("failed", "failed requests"), ("duration_s", "run time (s)"),
    ("request_throughput", "requests/s"), ("goodput", "goodput (requests/s in SLO)"),
    ("slo_fraction", "requests in SLO (share)"),
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


def tails(runs: Sequence[RunResult]) -> dict[str, Tails]:
    """Per label over all its repeats: the slowest requests and where their time went (tails.py).
    A label's timelines are None if none of its runs brought any back."""
    out = {}
    for label in dict.fromkeys(r.label for r in runs):
        mine = [r for r in runs if r.label == label]
        kept = [r.timelines for r in mine if r.timelines is not None]
        out[label] = Tails.of(label, [x for r in mine for x in r.results],
                              {k: v for t in kept for k, v in t.items()} if kept else None)
    return out


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


def has_slo(summary: dict[str, RunMetrics]) -> bool:
    return any(m.slo_fraction is not None for m in summary.values())


def table(summary: dict[str, RunMetrics]) -> str:
    """A plain-text table: one column per target, then one per ratio. Without an SLO, goodput says it needs one."""
    rel = ratios(summary)
    header = ["figure", *summary, *rel]
    rows = []
    flats = {label: flat(m) for label, m in summary.items()}
    keys = [(k, name) for k, name in ROWS] + [
        (f"{k}.{stat}", f"{name} {stat} (ms)") for k, name in LATENCIES for stat in ("mean", "p50", "p90", "p99")]
    for key, name in keys:
        if key in ("goodput", "slo_fraction") and not has_slo(summary):
            rows.append([name, *["needs --slo"] * len(summary), *["-"] * len(rel)])
            continue
        rows.append([name, *(_fmt(flats[label][key]) for label in summary), *(_fmt(r[key]) for r in rel.values())])
    return _columns(header, rows)


def _columns(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Rows of cells as aligned text: the first `left` columns to the left, the rest to the right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    return "\n".join(lines)


def slo_text(slo: dict[str, float]) -> str:
    """{'ttft': 2.0, 'tpot': 0.25} -> 'ttft <= 2000 ms, tpot <= 250 ms'."""
    return ", ".join(f"{name} <= {seconds * 1000:g} ms" for name, seconds in slo.items())


def headline(summary: dict[str, RunMetrics], slo: dict[str, float]) -> str:
    """One line: each target's throughput and goodput, then the base's ratios to the others."""
    def one(label: str, m: RunMetrics) -> str:
        text = f"{label} {_fmt(m.request_throughput)} requests/s ({_fmt(m.output_throughput)} output tok/s)"
        if slo:
            text += f", goodput {_fmt(m.goodput)} requests/s ({_percent(m.slo_fraction)} of requests in SLO)"
        return text
    parts = [one(label, m) for label, m in summary.items()]
    for pair, rel in ratios(summary).items():
        goodput = f", goodput {_times(rel['goodput'])}" if slo else ""
        parts.append(f"{pair} throughput {_times(rel['request_throughput'])}{goodput}")
    tail = f"SLO {slo_text(slo)}" if slo else "goodput needs an SLO (--slo ttft=2000,tpot=250, milliseconds)"
    return f"headline: {'; '.join(parts)}. {tail}"


def _percent(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.0%}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


# ---- sweeps: the same requests at several rates -------------------------------------------------
SWEEP_FIGURES = (("request_throughput", "requests/s"), ("output_throughput", "output tok/s"),
                 ("goodput", "goodput"), ("ttft_ms.p99", "TTFT p99 ms"), ("tpot_ms.p99", "TPOT p99 ms"),
                 ("itl_ms.p99", "ITL p99 ms"), ("e2el_ms.p99", "E2E p99 ms"))


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def sweep_rows(points: Sequence[tuple[float, dict[str, RunMetrics]]]) -> list[dict[str, Any]]:
    """One row per rate and target (then per ratio): the sweep summary, as the JSON keeps it."""
    rows = []
    for rate, summary in points:
        for label, m in summary.items():
            figures = flat(m)
            rows.append({"request_rate": rate, "label": label, **{k: figures[k] for k, _ in SWEEP_FIGURES}})
        for pair, rel in ratios(summary).items():
            rows.append({"request_rate": rate, "label": pair, **{k: rel[k] for k, _ in SWEEP_FIGURES}})
    return rows


def sweep_json(points: Sequence[tuple[float, Sequence[RunResult], dict[str, RunMetrics], dict[str, Tails] | None]],
               config: dict[str, Any]) -> dict[str, Any]:
    """A sweep's JSON: the config and machine once, the summary rows, then each rate as `to_json` gives a run."""
    return {"config": config, "machine": machine().as_dict(),
            "sweep_summary": sweep_rows([(rate, summary) for rate, _, summary, _ in points]),
            "sweep": [{"request_rate": rate, **{k: v for k, v in to_json(runs, summary, config, slowest).items()
                                                if k not in ("config", "machine")}}
                      for rate, runs, summary, slowest in points]}


def sweep_table(points: Sequence[tuple[float, dict[str, RunMetrics]]]) -> str:
    """Rate -> throughput, goodput and p99 latencies, one row per target and per ratio."""
    slo = any(has_slo(summary) for _, summary in points)
    header = ["rate (/s)", "server", *(name for _, name in SWEEP_FIGURES)]
    rows = [[rate_name(row["request_rate"]), row["label"],
             *("needs --slo" if key == "goodput" and not slo else _fmt(row[key]) for key, _ in SWEEP_FIGURES)]
            for row in sweep_rows(points)]
    return _columns(header, rows, left=2)


def plot_sweep(path: Path, points: Sequence[tuple[float, dict[str, RunMetrics]]], title: str) -> None:
    """p99 TTFT and p99 TPOT (and throughput beside goodput) against the request rate, one line per
    target; the rates at evenly spaced positions in increasing order, inf last as "all at once"."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(points, key=lambda point: point[0])
    x = list(range(len(ordered)))
    names = ["all at once" if math.isinf(rate) else rate_name(rate) for rate, _ in ordered]
    labels = list(dict.fromkeys(label for _, summary in ordered for label in summary))
    slo = any(has_slo(summary) for _, summary in ordered)

    def series(label: str, pick) -> list[float]:
        return [pick(summary[label]) if label in summary else math.nan for _, summary in ordered]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (name, pick) in zip(axes, (("TTFT p99 (ms)", lambda m: m.ttft_ms.p99),
                                       ("TPOT p99 (ms)", lambda m: m.tpot_ms.p99))):
        for label in labels:
            ax.plot(x, series(label, pick), marker="o", label=label)
        ax.set_ylabel(name)
    ax = axes[2]
    for label in labels:
        line, = ax.plot(x, series(label, lambda m: m.request_throughput), marker="o", label=f"{label} throughput")
        if slo:
            ax.plot(x, series(label, lambda m: m.goodput), marker="s", linestyle="--", color=line.get_color(),
                    label=f"{label} goodput")
    ax.set_ylabel("requests / s" + ("" if slo else " (goodput needs --slo)"))
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.set_xticks(x, names)
        ax.set_xlabel("request rate (/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def to_json(runs: Sequence[RunResult], summary: dict[str, RunMetrics], config: dict[str, Any],
            slowest: dict[str, Tails] | None = None) -> dict[str, Any]:
    """The run's figures, every request, and (if fetched) the slowest requests' timelines under "tails"."""
    def request(r) -> dict:
        return {"start": r.start, "ok": r.ok, "ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el,
                "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                "cached_tokens": r.cached_tokens, "error": r.error or None, "request_id": r.request_id}
    return {
        "config": config, "machine": machine().as_dict(),
        "summary": {label: dataclasses.asdict(m) for label, m in summary.items()},
        "ratios": ratios(summary),
        **({"tails": {label: t.as_dict() for label, t in slowest.items()}} if slowest is not None else {}),
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
