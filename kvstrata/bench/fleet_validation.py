"""`kvstrata simulate --validate --prefill-instances P --decode-instances D`: a real P:D fleet and P + D
colocated engines on this machine (kvstrata.bench.fleets), each driven through its router by the same
trace, beside what the simulator predicts for both on that trace.

The simulator is set up as the real engines run: their default block size, batch budget, step-time
target and KV memory, the store unbounded (one Redis, 2 GB, holds the traces this runs), the router's
policy (over the colocated engines, or the prefill engines), steps and store transfers from the profile
(a calibration of this machine with --threads as the engines have and --store on Redis: `kvstrata
calibrate --threads 1 --store redis://..`), and this machine's cores shared between the engines with a
serving overhead an earlier run measured (`SimConfig.host_cores`, `serving_overhead`). It is fed what
the fleets are fed, on one clock: the bench's warm-up requests, then each repeat's slice of `requests`
(`kvstrata bench serve --repeats` takes the trace's next slice each time) once the one before has
ended, so caches and the step-time fit carry over as in the engines; both sides pool the slices.

Compared, for each fleet and for their ratio (disaggregated / colocated): TTFT p50 and p99, TPOT p99,
ITL p99 and output throughput, with the simulator's relative error (simulated / measured - 1).
"""

from __future__ import annotations

import dataclasses
import os
from itertools import pairwise
from pathlib import Path

import numpy as np

from kvstrata.bench.fleets import KINDS, WARMUP_REQUESTS, FleetRun, FleetSpec, run_fleet
from kvstrata.bench.loadgen import WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN
from kvstrata.core.config import CacheConfig, SchedulerConfig
from kvstrata.sim.config import SimConfig
from kvstrata.sim.cost_model import CostModel
from kvstrata.sim.results import RequestRecord, SimResult
from kvstrata.sim.splits import replay_layouts
from kvstrata.sim.traces import TraceRequest, read_mooncake

# (label, the key in the bench's summary and in `pooled`'s figures, its statistic (None: a scalar))
FIGURES = (("TTFT p50 ms", "ttft_ms", "p50"), ("TTFT p99 ms", "ttft_ms", "p99"), ("TPOT p99 ms", "tpot_ms", "p99"),
           ("ITL p99 ms", "itl_ms", "p99"), ("output tok/s", "output_throughput", None))
GOAL = 0.10         # the simulator's target relative error (issue 31)
SLICE_GAP_S = 600.0  # simulated seconds from one slice's start to the next's (more if a slice outlasts it)


def engine_like_config(cost: CostModel, policy: str, local_prefill_tokens: int, host_cores: float | None = None,
                       serving_overhead: float = 0.0) -> SimConfig:
    """The simulator set up as `kvstrata serve`'s defaults run an engine (KV memory in the profile's blocks),
    on `host_cores` cores the fleet shares (None: a core per engine)."""
    cache, scheduling = CacheConfig(), SchedulerConfig()
    blocks = cache.kv_cache_memory // cost.block_bytes(cache.block_size)
    return SimConfig(block_size=cache.block_size, device_cache_tokens=blocks * cache.block_size,
                     store_cache_tokens=None, router=policy, max_num_seqs=scheduling.max_num_seqs,
                     max_num_batched_tokens=scheduling.max_num_batched_tokens, max_tpot_ms=scheduling.max_tpot_ms,
                     local_prefill_tokens=local_prefill_tokens, host_cores=host_cores,
                     serving_overhead=serving_overhead).validate()


def read_slices(trace: Path, requests: int, repeats: int) -> list[list[TraceRequest]]:
    """The trace's first `repeats` slices of `requests`, each from its own start (as the bench replays them)."""
    held = read_mooncake(trace)
    if len(held) < repeats * requests:
        raise ValueError(f"{trace} holds {len(held)} requests: {repeats} repeats of {requests} need "
                         f"{repeats * requests}")
    slices = [held[r * requests:(r + 1) * requests] for r in range(repeats)]
    return [[dataclasses.replace(request, arrival=request.arrival - part[0].arrival) for request in part]
            for part in slices]


def fleet_trace(slices: list[list[TraceRequest]], warmups: int, gap_s: float) -> list[TraceRequest]:
    """What the real fleet is sent, on one clock: the bench's warm-up requests at 0, then each slice
    `gap_s` after the one before began (the bench runs a repeat once the last one has ended and the
    cores are quiet)."""
    unused = 1 + max(i for part in slices for request in part for i in request.hash_ids)
    out = [TraceRequest(0.0, WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN, (unused + w,)) for w in range(warmups)]
    for r, part in enumerate(slices):
        out += [dataclasses.replace(request, arrival=(r + 1) * gap_s + request.arrival) for request in part]
    return out


def simulate_slices(trace: Path, requests: int, repeats: int, config: SimConfig, cost: CostModel, prefill: int,
                    decode: int, warmups: int = WARMUP_REQUESTS) -> dict[str, dict]:
    """Both fleets fed as the real ones are (`fleet_trace`: each engine's caches and step-time fit carry
    over from the warm-up and from one repeat to the next, as a real engine's do), figures pooled over
    the slices: the figures of FIGURES, in the bench's units."""
    slices, gap_s = read_slices(trace, requests, repeats), SLICE_GAP_S
    while True:
        layouts = replay_layouts(fleet_trace(slices, warmups, gap_s), config, cost, [(prefill, decode)])
        if all(apart(layout.result, warmups, requests, repeats) for layout in layouts):
            return {kind: pooled(layout.result, warmups, requests, repeats) for kind, layout in zip(KINDS, layouts)}
        gap_s *= 4                      # a slice outlasted the gap: space them further apart


def slices_of(result: SimResult, warmups: int, requests: int, repeats: int) -> list[list[RequestRecord]]:
    return [result.records[warmups + r * requests:warmups + (r + 1) * requests] for r in range(repeats)]


def apart(result: SimResult, warmups: int, requests: int, repeats: int) -> bool:
    """Whether every slice (and the warm-up) ended before the next began."""
    groups = [result.records[:warmups], *slices_of(result, warmups, requests, repeats)]
    groups = [group for group in groups if group]
    return all(max(r.finish for r in before) < min(r.arrival for r in after) for before, after in pairwise(groups))


def pooled(result: SimResult, warmups: int, requests: int, repeats: int) -> dict:
    """TTFT, TPOT and ITL in ms over every slice's requests; output tokens over the slices' summed spans (each
    from its first arrival to its last reply, as the bench sums its repeats' durations). The warm-up's
    inter-token gaps, all before the first slice's (`apart`), are left out."""
    slices = slices_of(result, warmups, requests, repeats)
    records = [record for part in slices for record in part]
    ttft = np.array([r.ttft for r in records]) * 1000
    tpot = np.array([r.tpot for r in records if r.output_tokens > 1]) * 1000
    warm_gaps = sum(max(0, r.output_tokens - 1) for r in result.records[:warmups])
    itl = np.frombuffer(result.itl, dtype=np.float64)[warm_gaps:] * 1000
    span = sum(max(r.finish for r in part) - min(r.arrival for r in part) for part in slices)
    stats = {name: {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}
             for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl))}
    return {**stats, "output_throughput": sum(r.output_tokens for r in records) / span, "requests": len(records),
            "step_cpu_s": sum(engine["step_cpu_s"] for engine in result.engines)}


def serving_overhead(run: FleetRun, simulated: dict) -> float:
    """What the fleet's processes used beyond its simulated steps, per second of them: this run's
    `serving_overhead` (its warm-up requests and idle store writes included)."""
    return sum(run.cpu_s.values()) / simulated["step_cpu_s"] - 1


def value(figures: dict, key: str, stat: str | None) -> float:
    return figures[key] if stat is None else figures[key][stat]


def compare(measured: dict[str, dict], simulated: dict[str, dict]) -> list[dict]:
    """One row per figure: measured and simulated for each fleet and for the ratio, and the errors."""
    rows = []
    for label, key, stat in FIGURES:
        real = [value(measured[kind], key, stat) for kind in KINDS]
        sim = [value(simulated[kind], key, stat) for kind in KINDS]
        real.append(real[0] / real[1])
        sim.append(sim[0] / sim[1])
        rows.append({"figure": label, "measured": real, "simulated": sim,
                     "error": [s / m - 1 if m else None for m, s in zip(real, sim)]})
    return rows


def validate_split(trace: Path, requests: int, output_len: int, cost: CostModel, out: Path, prefill: int = 1,
                   decode: int = 1, threads: int = 1, policy: str = "kv_aware", local_prefill_tokens: int = 0,
                   repeats: int = 1, port: int = 18300, overhead: float = 0.0) -> dict:
    """Run both real fleets and the simulator, and compare (files of the runs in `out`). The simulated fleets
    share this machine's cores, with `overhead` the serving overhead an earlier run measured."""
    cores = (os.cpu_count() or 1) / threads          # engine threads the machine runs at once
    config = engine_like_config(cost, policy, local_prefill_tokens, cores, overhead)
    simulated = simulate_slices(trace, requests, repeats, config, cost, prefill, decode)   # fails fast on a short trace
    runs: dict[str, FleetRun] = {}
    for kind in KINDS:
        spec = FleetSpec(kind, prefill, decode, threads, policy, local_prefill_tokens, port)
        runs[kind] = run_fleet(spec, trace, requests, output_len, out, repeats)
    measured = {kind: run.summary for kind, run in runs.items()}
    overheads = {kind: serving_overhead(run, simulated[kind]) for kind, run in runs.items()}
    return {"split": f"{prefill}P+{decode}D", "engines": prefill + decode, "requests": requests, "repeats": repeats,
            "profile": cost.source, "config": dataclasses.asdict(config),
            "fleets": {kind: run.to_json() for kind, run in runs.items()}, "simulated": simulated,
            "serving_overhead_measured": overheads, "rows": compare(measured, simulated)}


def within_goal(error: float) -> bool:
    return abs(error) <= GOAL + 1e-9        # 10.0% printed is within, whatever the last bit says


def comparison_table(report: dict) -> str:
    """The rows of `compare`, and how many errors are within GOAL."""
    split = report["split"]
    colocated = f"{report['engines']} colocated"
    lines = [f"{'':<14}" + "".join(f"{label:>33}" for label in (split, colocated, f"ratio ({split} / {colocated})")),
             f"{'':<14}" + f"{'measured':>12}{'simulated':>11}{'error':>10}" * 3]
    errors = []
    for row in report["rows"]:
        errors += row["error"]
        lines.append(f"{row['figure']:<14}" + "".join(
            f"{m:>12.2f}{s:>11.2f}" + (f"{e:>+10.1%}" if e is not None else f"{'n/a':>10}")
            for m, s, e in zip(row["measured"], row["simulated"], row["error"])))
    known = [e for e in errors if e is not None]
    fleets = [e for i, e in enumerate(errors) if i % 3 < 2 and e is not None]
    lines.append(f"within {GOAL:.0%}: {sum(map(within_goal, known))} of {len(known)} "
                 f"(the fleets' own figures {sum(map(within_goal, fleets))} of {len(fleets)})")
    config, measured = report.get("config", {}), report.get("serving_overhead_measured")
    if measured:
        lines.append(f"shared cores: {config['host_cores']:g} for the engines' threads, serving overhead "
                     f"{config['serving_overhead']:.2f} simulated; this run's fleets used "
                     + " and ".join(f"{used:.2f} ({kind})" for kind, used in measured.items())
                     + " (--serving-overhead for the next run)")
    return "\n".join(lines)
