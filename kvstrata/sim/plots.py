"""PNG plots of simulation results (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvstrata.sim.results import SimResult

logger = logging.getLogger(__name__)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_ttft_cdf(results: Sequence[SimResult], labels: Sequence[str], path: Path) -> Path:
    """One TTFT CDF per run, log-scaled time axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result, label in zip(results, labels):
        ttft = np.sort([r.ttft for r in result.records])
        ax.plot(np.maximum(ttft, 1e-4), np.arange(1, len(ttft) + 1) / len(ttft), label=label or None)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    if any(labels):
        ax.legend()
    return _save(fig, plt, path)


def plot_hit_rate(reports: Sequence[dict], parameter: str, values: Sequence[int | None], path: Path) -> Path:
    """Hit rate (by tier, cumulative) against a capacity, beside the infinite-cache ideal.

    `reports` are `SimResult.to_json()` figures, one per value; an unbounded value is drawn right
    of the largest finite one.
    """
    plt = _pyplot()
    finite = [v for v in values if v is not None]
    xs = [max(finite, default=1) * 2 if v is None else v for v in values]
    ideal = reports[0]["ideal_hit_rate"]
    device = [r["hit_rate"]["device"] for r in reports]
    host = [r["hit_rate"]["device"] + r["hit_rate"]["host"] for r in reports]
    total = [r["hit_rate"]["total"] for r in reports]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot(xs, total, "o-", label="total (device + host + store)")
    if any(r["hit_rate"]["store"] > 0 for r in reports):
        ax.plot(xs, host, "s--", label="device + host")
    ax.plot(xs, device, "^:", label="device")
    ax.axhline(ideal, color="k", linestyle="--", label=f"ideal (infinite cache) {ideal:.3f}")
    ax.set_xscale("symlog", linthresh=max(min((x for x in xs if x > 0), default=1), 1))
    ax.set_xticks(xs, ["inf" if v is None else f"{v:,}" for v in values], rotation=30, fontsize=8)
    ax.margins(x=0.05)
    ax.set_xlabel(parameter.replace("_", " ") + (" (shared)" if parameter.startswith("store") else " (per engine)"))
    ax.set_ylabel("hit rate (share of prompt blocks)")
    ax.set_ylim(0, max(max(total), ideal) * 1.15)
    config = reports[0]["config"]
    device_tokens = "inf" if config["device_cache_tokens"] is None else f"{config['device_cache_tokens']:,}"
    ax.set_title(f"{reports[0]['requests']:,} requests on {config['instances']} engine(s) "
                 f"({config['router']}), block {config['block_size']}, device {device_tokens} tokens", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)
    return path
