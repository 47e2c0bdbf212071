"""`kvstrata simulate --validate --speculative-config JSON`: the speed-up the simulator predicts for
speculative decoding against the one the real engine measures.

A slice is replayed on the engine twice at each load, without and with speculation; the
speculative run's own counters give the workload's acceptance (accepted drafts per position over
steps with drafts, how long the drafts were, and the share of decodes that found one: `DraftCounts`), and the simulator
replays the slice without and with speculation at that acceptance. Compared: the speed-ups
(throughput, TPOT p50 and p99, with over without), each side's figures, and the time of the steps
that carried drafts, engine against profile. The acceptance is measured, not predicted: what this
checks is the cost of verifying drafts (a 1 + K-row chunk, priced as a chunk continuing its
sequence) and the scheduling around it, which is what the simulator adds.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path

from kvstrata.calibration.engine_replay import EngineRun, loadavg, replay_on_engine
from kvstrata.calibration.fitted_on import check_not_fitted_on, slice_identity
from kvstrata.calibration.slices import Slice, time_scale_for
from kvstrata.calibration.validation import CLOCK_NAMES, LOADS
from kvstrata.core.config import SpeculativeConfig
from kvstrata.sim.config import SimConfig
from kvstrata.sim.cost_model import CostModel
from kvstrata.sim.results import TIERS, summarize
from kvstrata.sim.simulator import Simulator
from kvstrata.sim.speculation import Acceptance, speedup
from kvstrata.sim.traces import TraceRequest

logger = logging.getLogger(__name__)

SPEC_LOADS = {name: LOADS[name] for name in ("light", "near")}   # where a stream's TPOT is its step time


def engine_summary(run: EngineRun, trace: list[TraceRequest], block_size: int) -> dict:
    blocks = sum(math.ceil(r.input_length / block_size) for r in trace)
    return summarize(run.records, {tier: run.hit_tokens.get(tier, 0) // block_size for tier in TIERS}, blocks)


def measured_acceptance(run: EngineRun) -> Acceptance:
    drafts = run.drafts
    assert drafts is not None, "a replay without speculation has no acceptance"
    return Acceptance.measured(drafts.num_drafts, drafts.accepted_per_pos, drafts.draft_rate, drafts.drafted_per_pos)


def drafted_step_times(run: EngineRun, cost: CostModel) -> dict:
    """The steps that carried drafts: their engine time against the profile's."""
    assert run.drafts is not None
    steps = [run.steps[i] for i in run.drafts.drafted_steps]
    engine, profile = sum(t for _, t in steps), sum(cost.step_seconds(s) for s, _ in steps)
    return {"steps": len(steps), "engine_s": engine, "profile_s": profile,
            "error": profile / engine - 1 if engine else None}


def validate_level(trace: list[TraceRequest], config: SimConfig, spec: SpeculativeConfig, cost: CostModel,
                   time_scale: float, threads: int | None, clock: str, loaded=None) -> dict:
    """One time scale: the engine without and with speculation, then the simulator both ways at the
    acceptance the engine measured."""
    trace = [replace(r, arrival=r.arrival * time_scale) for r in trace]
    loads = [loadavg()]
    runs = {}
    for name, engine_config in (("without", config), ("with", replace(config, speculative=spec))):
        runs[name] = replay_on_engine(trace, engine_config, threads, clock, loaded)
        loads.append(loadavg())
    acceptance = measured_acceptance(runs["with"])
    engine = {name: engine_summary(run, trace, config.block_size) for name, run in runs.items()}
    sim_runs = {"without": Simulator(trace, config, cost).run(),
                "with": Simulator(trace, replace(config, speculative=spec, acceptance=acceptance), cost).run()}
    sim = {name: result.to_json() for name, result in sim_runs.items()}
    drafts = runs["with"].drafts
    engine_gain, sim_gain = speedup(engine["without"], engine["with"]), speedup(sim["without"], sim["with"])
    return {"time_scale": time_scale,
            "speedup": {name: {"engine": engine_gain[name], "simulator": sim_gain[name],
                               "relative_error": sim_gain[name] / engine_gain[name] - 1 if engine_gain[name] else None}
                        for name in engine_gain},
            "figures": {side: {name: {"throughput_tok_s": report["throughput_tok_s"], "tpot_s": report["tpot_s"],
                                      "ttft_s": report["ttft_s"]}
                               for name, report in reports.items()}
                        for side, reports in (("engine", engine), ("simulator", sim))},
            "acceptance": {"per_position": list(acceptance.per_position), "draft_rate": acceptance.draft_rate,
                           "draft_lengths": list(acceptance.draft_lengths),
                           "engine": {"num_drafts": drafts.num_drafts, "num_draft_tokens": drafts.num_draft_tokens,
                                      "num_accepted_tokens": drafts.num_accepted_tokens},
                           "simulator": sim["with"]["speculation"]},
            "drafted_steps": drafted_step_times(runs["with"], cost),
            "steps": {name: {"engine": len(run.steps), "simulator": sim[name]["steps"]} for name, run in runs.items()},
            "tpot_s": {name: {"engine": [r.tpot for r in run.records], "simulator": [r.tpot for r in sim_runs[name].records]}
                       for name, run in runs.items()},
            "loadavg": loads}


def validate_speculation(path: str | Path, slice_: Slice, spec: SpeculativeConfig, cost: CostModel,
                         threads: int | None, clock: str, time_scales: dict[str, float] | None = None,
                         max_num_seqs: int = 32) -> dict:
    """A slice at each load (or given time scales), the speed-up of speculation, engine against simulator."""
    trace, lines = slice_.load(path)
    identity = slice_identity(path, slice_.name, lines)
    check_not_fitted_on(cost, identity)
    config = slice_.sim_config(max_num_seqs)
    if time_scales is None:
        time_scales = {name: time_scale_for(trace, cost, load, slice_.tokens_per_id) for name, load in SPEC_LOADS.items()}
    from kvstrata.core.config import ModelConfig
    from kvstrata.model.loader import load_model

    loaded = load_model(ModelConfig(threads=threads))
    levels = {}
    for name, scale in time_scales.items():
        logger.info("slice %s, %s: %d requests, without and with speculation (time scale %.3g)", slice_.name,
                    name, len(trace), scale)
        levels[name] = validate_level(trace, config, spec, cost, scale, threads, clock, loaded)
    return {"slice": {**slice_.__dict__, **{k: identity[k] for k in ("trace", "sha256", "lines")}},
            "requests": len(trace), "clock": CLOCK_NAMES[clock], "profile": cost.source,
            "speculative_config": spec.__dict__, "levels": levels}
