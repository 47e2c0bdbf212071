"""`kvstrata simulate --validate`: a trace slice replayed on the real engine and in the simulator, compared.

A validation names a slice (`kvstrata.calibration.slices`) and replays it at three *loads*: the
offered work is `light` 0.3, `near` 1.0 and `overload` 3.0 of the time the arrivals span (decodes
batch, so `near` is near, not past, capacity; `overload` runs well past its arrivals). Each load
reports TTFT p50/p90/p99, TPOT p50, throughput and the hit rate per tier, engine against
simulator, with the machine's load average before and after each engine run and a speed probe
against the one calibration timed (`kvstrata.calibration.engine_replay`). `repeat` replays the
engine again and reports the spread: an error inside that spread is noise, not the model. A
slice the profile was fitted on is refused (`kvstrata.calibration.fitted_on`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvstrata.calibration.engine_replay import loadavg, probe_now, replay_on_engine
from kvstrata.calibration.fitted_on import (
    check_not_fitted_on,
    check_same_clock,
    check_same_path,
    engine_path,
    slice_identity,
)
from kvstrata.calibration.slices import Slice, time_scale_for
from kvstrata.sim.batch_shape import BatchShape
from kvstrata.sim.config import SimConfig
from kvstrata.sim.cost_model import CostModel
from kvstrata.sim.results import TIERS, summarize
from kvstrata.sim.simulator import Simulator
from kvstrata.sim.traces import TraceRequest

logger = logging.getLogger(__name__)

LOADS = {"light": 0.3, "near": 1.0, "overload": 3.0}     # offered work / span of the arrivals
CLOCK_NAMES = {"cpu": "engine-thread CPU time (and the wall time a step that ran nothing waited for the store)",
               "wall": "wall time"}


def calibrated_probe(cost: CostModel) -> float | None:
    return next((f.get("probe_s") for f in cost.fitted_on if f.get("kind") == "grid"), None)


FIGURES = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s",
           *(f"hit_rate_{tier}" for tier in (*TIERS, "total")))


def figures(report: dict) -> dict[str, float]:
    """The compared figures (FIGURES) of one `summarize` report."""
    out = {"ttft_p50_s": report["ttft_s"]["p50"], "ttft_p90_s": report["ttft_s"]["p90"],
           "ttft_p99_s": report["ttft_s"]["p99"], "tpot_p50_s": report["tpot_s"]["p50"],
           "throughput_tok_s": report["throughput_tok_s"]}
    out.update({f"hit_rate_{tier}": report["hit_rate"][tier] for tier in (*TIERS, "total")})
    assert tuple(out) == FIGURES
    return out


TIMING = FIGURES[:5]                  # the figures a profile predicts: the hit rates are the caches', not its


@dataclass(frozen=True)
class Verdict:
    """How many of a validation's timing figures (TIMING at each load) the simulator got within
    `tolerance` of the engine (the mean of its runs), how many of the rest lie within the engine's own
    spread over its runs (max / min - 1: the machine's noise, not the model's error), and the worst."""

    within: int
    total: int
    tolerance: float
    worst: tuple[str, str, float]                 # load, figure, relative error
    within_noise: int = 0

    def line(self) -> str:
        load, name, error = self.worst
        noise = f"; {self.within_noise} more within the engine's own spread" if self.within_noise else ""
        return (f"{self.within} of {self.total} timing figures within {self.tolerance:.0%} of the engine{noise}; "
                f"the worst: {name} at {load}, {error:+.1%}")


def verdict(report: dict, tolerance: float = 0.05) -> Verdict:
    """`report` (from `validate`) summed up: each figure's error against the mean of the engine's runs."""
    errors, noise = [], 0
    for load, level in report["levels"].items():
        for name in TIMING:
            row = level["figures"][name]
            engine = sum(row["engine"]) / len(row["engine"])
            error = row["simulator"] / engine - 1 if engine else math.inf
            errors.append((load, name, error))
            spread = row.get("engine_spread") or 0.0
            noise += tolerance < abs(error) <= spread
    worst = max(errors, key=lambda e: abs(e[2]))
    return Verdict(sum(abs(e) <= tolerance for _, _, e in errors), len(errors), tolerance, worst, noise)


def validation_table(report: dict) -> str:
    """One block per load: each figure's engine value(s), the simulator's, and the error(s); then how many
    timing figures are within 5%."""
    lines = [f"{report['requests']} requests, steps timed by {report['clock']}"]
    for level, data in report["levels"].items():
        runs = data["engine_runs"]
        loads = "; ".join(f"{r['loadavg_before'][0]:.2f}->{r['loadavg_after'][0]:.2f}" for r in runs)
        speed = ", ".join("n/a" if r["speed_ratio"] is None else f"{r['speed_ratio']:.3f}" for r in runs)
        steps = [r["step_seconds"] for r in runs]
        busy = ", ".join(f"{r['busy_share']:.0%}" for r in runs)
        same = ", ".join(f"engine {s['engine']:.1f}s profile {s['profile']:.1f}s ({s['profile'] / s['engine'] - 1:+.1%})"
                         for s in steps if s["engine"])
        lines.append(f"\n{level}: time scale {data['time_scale']:.4g}, engine busy {busy}, loadavg (1 min) {loads}, "
                     f"probe vs calibration {speed}; the same batches: {same}")
        kinds = runs[0]["step_kinds"]
        lines.append("  steps of the first run, profile against engine: " + "; ".join(
            f"{kind} {k['steps']}x {k['profile_s'] / k['engine_s'] - 1:+.1%}" for kind, k in kinds.items() if k["engine_s"]))
        lines.append(f"{'':20}{'engine':>26}{'simulator':>11}{'error':>20}")
        for name, row in data["figures"].items():
            engine = " ".join(f"{v:.4f}" for v in row["engine"])
            errors = " ".join("n/a" if e is None else f"{e:+.1%}" for e in row["relative_error"])
            lines.append(f"{name:20}{engine:>26}{row['simulator']:11.4f}{errors:>20}")
    lines.append(f"\n{verdict(report).line()}")
    return "\n".join(lines)


def step_kind(shape: BatchShape) -> str:
    """A step's kind for the error breakdown: what dominates its cost."""
    if shape.prefill_tokens and shape.decode_seqs:
        return "mixed"
    if shape.prefill_tokens:
        several = "s" if shape.prefill_chunks > 1 else ""
        return f"prefill{several} ({'fresh' if not shape.masked_pairs else 'continued' if not shape.attention_pairs else 'both'})"
    return f"decode x{shape.decode_seqs}" if shape.decode_seqs < 4 else "decode x4+"


def step_breakdown(steps: list[tuple[BatchShape, float]], cost: CostModel) -> dict[str, dict]:
    """Engine time against the profile's, per kind of step: where a step-time error comes from."""
    out: dict[str, dict] = {}
    for shape, seconds in steps:
        row = out.setdefault(step_kind(shape), {"steps": 0, "engine_s": 0.0, "profile_s": 0.0})
        row["steps"] += 1
        row["engine_s"] += seconds
        row["profile_s"] += cost.step_seconds(shape)
    return dict(sorted(out.items()))


def validate_level(trace: list[TraceRequest], config: SimConfig, cost: CostModel, time_scale: float,
                   threads: int | None, clock: str, repeat: int = 1, loaded=None) -> dict:
    """One slice at one time scale: the simulator once (it is deterministic), the engine `repeat` times."""
    trace = [replace(r, arrival=r.arrival * time_scale) for r in trace]
    size = config.block_size
    blocks = sum(math.ceil(r.input_length / size) for r in trace)
    result = Simulator(trace, config, cost).run()
    sim_report = result.to_json()
    sim_figures = figures(sim_report)
    runs = []
    reference = calibrated_probe(cost)
    for _ in range(repeat):
        before, wall = loadavg(), time.perf_counter()
        probe = probe_now(loaded, threads, clock) if loaded is not None else None
        run = replay_on_engine(trace, config, threads, clock, loaded)
        real = summarize(run.records, {tier: run.hit_tokens.get(tier, 0) // size for tier in TIERS}, blocks)
        busy = sum(t for _, t in run.steps) + run.waited_s
        runs.append({"figures": figures(real), "loadavg_before": before, "loadavg_after": loadavg(),
                     "probe_s": probe, "speed_ratio": probe / reference if probe and reference else None,
                     "wall_s": time.perf_counter() - wall, "engine_s": real["simulated_s"],
                     "busy_share": busy / real["simulated_s"] if real["simulated_s"] else 0.0,
                     "waited_for_store_s": run.waited_s, "preemptions": run.preemptions,
                     "step_seconds": {"steps": len(run.steps), "engine": sum(t for _, t in run.steps),
                                      "profile": sum(cost.step_seconds(s) for s, _ in run.steps)},
                     "step_kinds": step_breakdown(run.steps, cost),
                     "ttft_s": [r.ttft for r in run.records], "tpot_s": [r.tpot for r in run.records],
                     "cached_tokens": [r.cached_tokens for r in run.records]})
    rows = {}
    for name, got in sim_figures.items():
        wants = [r["figures"][name] for r in runs]
        errors = [got / want - 1 if want else None for want in wants]
        known = [e for e in errors if e is not None]
        rows[name] = {"engine": wants, "simulator": got, "relative_error": errors,
                      "engine_spread": (max(wants) / min(wants) - 1) if min(wants) > 0 else None,
                      "error_mean": sum(known) / len(known) if known else None}
    return {"time_scale": time_scale, "figures": rows, "engine_runs": runs,
            "simulator": {**{k: sim_report[k] for k in ("preemptions", "steps", "transfers", "simulated_s")},
                          "ttft_s": [r.ttft for r in result.records], "tpot_s": [r.tpot for r in result.records],
                          "cached_tokens": [r.cached_tokens for r in result.records]}}


def validate(path: str | Path, slice_: Slice, cost: CostModel, threads: int | None, clock: str,
             loads: dict[str, float] | None = None, time_scales: dict[str, float] | None = None,
             repeat: int = 1, max_num_seqs: int = 32) -> dict:
    """A slice at each load (or at given time scales), engine against simulator; refuses a fitted-on slice."""
    trace, lines = slice_.load(path)
    identity = slice_identity(path, slice_.name, lines)
    check_not_fitted_on(cost, identity)
    check_same_clock(cost, clock)
    config = slice_.sim_config(max_num_seqs)
    if time_scales is None:
        time_scales = {name: time_scale_for(trace, cost, load, slice_.tokens_per_id)
                       for name, load in (loads or LOADS).items()}
    import torch

    from kvstrata.core.config import ModelConfig
    from kvstrata.model.loader import load_model

    loaded = load_model(ModelConfig(threads=threads))        # one load for every engine of the validation
    check_same_path(cost, engine_path(loaded.runs(), torch.get_num_threads()))
    levels = {}
    for name, scale in time_scales.items():
        logger.info("slice %s, %s: %d requests over %.0f s (time scale %.3g)", slice_.name, name, len(trace),
                    trace[-1].arrival * scale, scale)
        levels[name] = validate_level(trace, config, cost, scale, threads, clock, repeat, loaded)
    return {"slice": {**slice_.__dict__, **{k: identity[k] for k in ("trace", "sha256", "lines")}},
            "requests": len(trace), "clock": CLOCK_NAMES[clock], "profile": cost.source, "levels": levels}
