"""`kvstrata simulate`: what it runs (its flags: simulate_flags.py), sweeps, plots and `--validate`.

    kvstrata simulate --trace T --output-json out.json                       one engine, H100 roofline
    kvstrata simulate --trace T --instances 16 --router kv_aware --host-cache-tokens 8M \\
                      --store-cache-tokens inf --output-json fleet.json
    kvstrata simulate --trace T --sweep host_cache_tokens=0,1M,4M,inf --plot docs/ --output-json sweep.json
    kvstrata simulate --validate --slice sessions --repeat 2 --trace T        engine vs simulator, three loads
    kvstrata simulate --trace T --speculative-config '{"num_speculative_tokens": 4}' --spec-acceptance 0.7
                                                    what speculation buys: the trace with and without it
    kvstrata simulate --trace T --prefill-instances 1 --decode-instances 3 --store-cache-tokens inf \
                      --router kv_aware                          a P:D split against P+D colocated engines
    kvstrata simulate --validate --trace T --prefill-instances 1 --decode-instances 1 --router kv_aware \
                      --profile P                        a real 1P+1D fleet and 2 colocated engines vs simulator
    kvstrata simulate --trace T --pd-splits 1:3,2:2,3:1 --store-cache-tokens inf --slo-ttft-ms 2000 \
                      --slo-tpot-ms 100           several splits, colocated beside them, the one to run

Profiles come from `kvstrata calibrate` (kvstrata.entrypoints.cli.calibrate). Only the command
modules print; the simulator itself returns figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from kvstrata.core.config import SpeculativeConfig, parse_size
from kvstrata.entrypoints.cli.calibrate import engine_timing, profile_for_this_machine
from kvstrata.sim.config import SimConfig
from kvstrata.sim.cost_model import CostModel
from kvstrata.sim.results import SimResult
from kvstrata.sim.roofline import roofline
from kvstrata.sim.simulator import Simulator
from kvstrata.sim.speculation import DEFAULT_ALPHA, Acceptance, speedup
from kvstrata.sim.traces import read_mooncake

CAPACITIES = ("device_cache_tokens", "host_cache_tokens", "store_cache_tokens")
FROM_PROFILE = -1       # --device-cache-tokens default: what the profile's hardware holds
OVERLOAD_FACTOR = 1.25  # a run this much longer than its arrivals' span was limited by the fleet, not by arrivals


def tokens(text: str) -> int | None:
    """'inf' -> None (unbounded); '8M' -> 8000000; '65536' -> 65536."""
    return None if text.strip().lower() in ("inf", "unbounded") else parse_size(text)


def cost_model(args: argparse.Namespace) -> CostModel:
    if args.profile is not None:
        return CostModel.load(args.profile)
    return roofline(args.hardware or "h100", args.model)


def sim_config(args: argparse.Namespace, cost: CostModel) -> SimConfig:
    device = args.device_cache_tokens
    if device == FROM_PROFILE:
        if cost.device_cache_tokens is None:
            raise ValueError("this profile does not say how much KV the device holds; pass --device-cache-tokens")
        device = cost.device_cache_tokens
    defaults = SimConfig()
    return SimConfig(block_size=args.block_size or defaults.block_size, device_cache_tokens=device,
                     host_cache_tokens=args.host_cache_tokens, store_cache_tokens=args.store_cache_tokens,
                     instances=args.instances, router=args.router,
                     max_num_seqs=args.max_num_seqs or defaults.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens or defaults.max_num_batched_tokens,
                     policy=args.policy, max_tpot_ms=args.max_tpot_ms, write_policy=args.write_policy,
                     store_timeout=args.store_timeout, local_prefill_tokens=args.local_prefill_tokens,
                     host_cores=args.host_cores, serving_overhead=args.serving_overhead,
                     audit=args.audit, swa_full=args.swa_full, **speculation(args)).validate()


def speculation(args: argparse.Namespace) -> dict:
    """SimConfig's speculative fields from the flags (none without --speculative-config)."""
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None:
        if (args.spec_acceptance, args.spec_draft_rate, args.spec_draft_lengths) != (None, None, None):
            raise ValueError("--spec-acceptance, --spec-draft-rate and --spec-draft-lengths need --speculative-config")
        return {}
    rate = 1.0 if args.spec_draft_rate is None else args.spec_draft_rate
    acceptance = Acceptance.parse(args.spec_acceptance or str(DEFAULT_ALPHA), rate, args.spec_draft_lengths)
    return {"speculative": spec, "acceptance": acceptance}


def run_simulate(args: argparse.Namespace) -> int:
    if args.validate:
        return run_validation(args)
    trace = read_mooncake(args.trace, args.max_requests, args.skip or 0, args.time_scale or 1.0, args.max_input_tokens,
                          args.max_output_tokens)
    cost = cost_model(args)
    elsewhere = cost.other_machine()
    if elsewhere:
        # Capacity planning for the machine a profile came from is a fine use: say so, do not refuse.
        print(f"note: {elsewhere}; the figures below are for that machine (`kvstrata calibrate` fits one for this)")
    base = sim_config(args, cost)
    if args.prefill_instances is not None or args.decode_instances is not None or args.pd_splits is not None:
        return run_disaggregated(args, trace, base, cost)
    if args.sweep is None and base.speculative is not None:
        return compare_speculation(args, trace, base, cost)
    if args.sweep is None:
        result = simulate(trace, base, cost)
        report = result.to_json()
        results = [(None, result)]
    else:
        name, values = parse_sweep(args.sweep)
        results = [(value, simulate(trace, dataclasses.replace(base, **{name: value}), cost, f"{name}={value}"))
                   for value in values]
        report = {"sweep": {"parameter": name, "values": values}, "ideal_hit_rate": results[0][1].ideal_hit_rate,
                  "profile": cost.source, "runs": [r.to_json() for _, r in results]}
    write_json(args.output_json, report)
    labels = [""] if args.sweep is None else [f"{name}={'inf' if v is None else f'{v:,}'}" for v, _ in results]
    for label, (_, result) in zip(labels, results):
        print(headline(result.to_json(), f"{label}: " if label else ""))
        warning = overload_warning(trace, result.to_json(), result.config.instances)
        if warning:
            print(f"{label + ': ' if label else ''}{warning}")
    if args.plot is not None:
        from kvstrata.sim.plots import plot_hit_rate, plot_ttft_cdf
        paths = [plot_ttft_cdf([r for _, r in results], labels, args.plot / "ttft_cdf.png")]
        if args.sweep is not None:
            paths.append(plot_hit_rate(report["runs"], name, values, args.plot / f"hit_rate_vs_{name}.png"))
        print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def compare_speculation(args: argparse.Namespace, trace, config: SimConfig, cost: CostModel) -> int:
    """The trace without and with speculation, and the ratios: what speculation buys this fleet."""
    plain = simulate(trace, dataclasses.replace(config, speculative=None, acceptance=None), cost, "without").to_json()
    spec = simulate(trace, config, cost, "with").to_json()
    gains = speedup(plain, spec)
    write_json(args.output_json, {"without": plain, "with": spec, "speedup": gains})
    print(headline(plain, "without speculation: "))
    print(headline(spec, "with speculation:    "))
    drafts = spec["speculation"]
    print(f"speculation ({config.speculative.num_speculative_tokens} drafts): throughput x{gains['throughput']:.2f}, "
          f"TPOT p50 x{gains['tpot_p50']:.2f} ({plain['tpot_s']['p50'] * 1000:.1f} -> {spec['tpot_s']['p50'] * 1000:.1f} "
          f"ms), p99 x{gains['tpot_p99']:.2f} ({plain['tpot_s']['p99'] * 1000:.1f} -> {spec['tpot_s']['p99'] * 1000:.1f} "
          f"ms); {drafts['num_drafts']:,} steps with drafts, acceptance rate {drafts['acceptance_rate']:.2f}, "
          f"mean accepted length {drafts['mean_accepted_length']:.2f}, mean draft {drafts['mean_draft_length']:.2f}")
    return 0


def run_disaggregated(args: argparse.Namespace, trace, base: SimConfig, cost: CostModel) -> int:
    """P:D splits and colocated fleets of their sizes on the same trace: TTFT, TPOT and ITL side by side,
    and with an SLO the layout to run (kvstrata.sim.splits)."""
    from kvstrata.sim.splits import Slo, parse_splits, recommend, replay_layouts

    pair = (args.prefill_instances, args.decode_instances)
    one_split = None not in pair
    if args.sweep is not None or (pair != (None, None) and not one_split) or one_split == (args.pd_splits is not None):
        raise ValueError("give --prefill-instances and --decode-instances together, or --pd-splits, without --sweep")
    splits = parse_splits(args.pd_splits) if args.pd_splits is not None else [pair]
    slo = Slo(None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000,
              None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000)
    layouts = replay_layouts(trace, base, cost, splits)
    report = {"layouts": [layout.figures(slo) for layout in layouts], "profile": cost.source}
    if slo.given:
        report["slo"] = dataclasses.asdict(slo)
        report["recommended"] = {size: layout.label for size, layout in recommend(layouts, slo).items()}
    write_json(args.output_json, report)
    print(layouts_table(report["layouts"]))
    if slo.given:
        for size, label in report["recommended"].items():
            print(f"{size} engines, SLO {slo.describe()}: run {label}")
    return 0


def layouts_table(layouts: list[dict]) -> str:
    """One row per layout: TTFT, TPOT and ITL percentiles, throughput, and the SLO's attainment if any."""
    slo = "slo_attainment" in layouts[0]
    lines = [f"{'':<14}{'TTFT p50 s':>11}{'TTFT p99 s':>11}{'TPOT p50 ms':>12}{'TPOT p99 ms':>12}"
             f"{'ITL p99 ms':>11}{'tok/s':>9}" + (f"{'SLO met':>9}" if slo else "")]
    for run in layouts:
        ttft, tpot = run["ttft_s"], run["tpot_s"]
        lines.append(f"{run['layout']:<14}{ttft['p50']:>11.3f}{ttft['p99']:>11.3f}{tpot['p50'] * 1000:>12.1f}"
                     f"{tpot['p99'] * 1000:>12.1f}{run['itl_s']['p99'] * 1000:>11.1f}{run['throughput_tok_s']:>9.0f}"
                     + (f"{run['slo_attainment']:>9.1%}" if slo else ""))
    return "\n".join(lines)


def run_validation(args: argparse.Namespace) -> int:
    """`--validate`: a slice at three loads (or one --time-scale), on the real engine and in the simulator."""
    from kvstrata.calibration.slices import SLICES
    from kvstrata.calibration.validation import validate, validation_table

    profile = args.profile or profile_for_this_machine()
    if profile is None:
        raise ValueError("no profile in benchmarks/profiles was calibrated on this machine, and validation times "
                         "the real engine here against one: run `kvstrata calibrate` (~2 min a --repeat) first, "
                         "or pass --profile")
    cost = CostModel.load(profile)
    elsewhere = cost.other_machine()
    if elsewhere:
        raise ValueError(f"{elsewhere}. Validation times the real engine here against the profile: calibrate on "
                         f"this machine first (`kvstrata calibrate --output my-profile.json`, ~10 min) and pass "
                         f"--profile my-profile.json")
    if args.prefill_instances is not None or args.decode_instances is not None:
        return run_fleet_validation(args, cost)
    spec = SpeculativeConfig.parse(args.speculative_config)
    chosen = SLICES[args.slice or ("plain" if spec is None else "speculative")]
    overrides = {"skip": args.skip, "requests": args.max_requests, "max_input_tokens": args.max_input_tokens,
                 "max_output_tokens": args.max_output_tokens}
    chosen = dataclasses.replace(chosen, **{k: v for k, v in overrides.items() if v is not None})
    scales = None if args.time_scale is None else {"given": args.time_scale}
    print(f"validating slice {chosen.name!r} with {cost.source}")
    if spec is not None:
        from kvstrata.calibration.speculation import validate_speculation

        report = validate_speculation(args.trace, chosen, spec, cost, *engine_timing(args), scales,
                                      args.max_num_seqs or 32)
        print(speculation_table(report))
        write_json(args.output_json, report)
        return 0
    report = validate(args.trace, chosen, cost, *engine_timing(args), time_scales=scales, repeat=args.repeat,
                      max_num_seqs=args.max_num_seqs or 32)
    print(validation_table(report))
    write_json(args.output_json, report)
    return 0


def run_fleet_validation(args: argparse.Namespace, cost: CostModel) -> int:
    """`--validate --prefill-instances P --decode-instances D`: the real P:D fleet and P + D colocated engines
    on this machine, each behind its router, against the simulator's prediction for both."""
    import tempfile

    from kvstrata.bench.fleet_validation import comparison_table, validate_split

    if None in (args.prefill_instances, args.decode_instances):
        raise ValueError("give --prefill-instances and --decode-instances together")
    if args.speculative_config is not None or args.sweep is not None or args.pd_splits is not None:
        raise ValueError("--validate of a P:D fleet takes neither --speculative-config, --sweep nor --pd-splits")
    reshaped = [flag for flag, value in (("--skip", args.skip), ("--time-scale", args.time_scale),
                                         ("--max-input-tokens", args.max_input_tokens),
                                         ("--max-output-tokens", args.max_output_tokens)) if value is not None]
    if reshaped:      # the fleets get the trace as written; write the slice you want to a file of its own
        raise ValueError(f"--validate of a P:D fleet replays the trace as written: {', '.join(reshaped)} not taken")
    repeats, threads = args.repeat, args.threads or 1         # engines of one thread, as --host-cores counts them
    trace = read_mooncake(args.trace)
    requests = args.max_requests or len(trace) // repeats
    if requests < 1:
        raise ValueError(f"{args.trace} holds {len(trace)} requests, fewer than --repeat {repeats}")
    output_len = max(r.output_length for r in trace)
    if "redis" not in cost.source:
        print("note: this profile's store link was not timed against Redis, the fleets' store "
              "(`kvstrata calibrate --threads 1 --store redis://HOST:PORT/0`)")
    out = Path(tempfile.mkdtemp(prefix="kvstrata-fleet-validation-"))
    print(f"validating {args.prefill_instances}P+{args.decode_instances}D against "
          f"{args.prefill_instances + args.decode_instances} colocated engines ({args.router}) with {cost.source}: "
          f"{requests} requests x {repeats} repeats, {threads} thread(s) per engine, a fresh Redis per fleet; "
          f"logs in {out}", flush=True)
    report = validate_split(Path(args.trace), requests, output_len, cost, out, args.prefill_instances,
                            args.decode_instances, threads, args.router, args.local_prefill_tokens, repeats,
                            overhead=args.serving_overhead)
    print(comparison_table(report))
    write_json(args.output_json, report)
    return 0


def speculation_table(report: dict) -> str:
    """One block per load: the speed-ups of speculation, engine against simulator, and the acceptance."""
    lines = [f"{report['requests']} requests, steps timed by {report['clock']}"]
    for level, data in report["levels"].items():
        accepted = data["acceptance"]
        drafted = data["drafted_steps"]
        error = "n/a" if drafted["error"] is None else f"{drafted['error']:+.1%}"
        loads = " -> ".join(f"{load[0]:.2f}" for load in data["loadavg"] if load)
        lines.append(f"\n{level}: time scale {data['time_scale']:.4g}, loadavg (1 min) {loads}; measured acceptance per position "
                     f"{', '.join(f'{a:.2f}' for a in accepted['per_position'])}, draft lengths "
                     f"{', '.join(f'{s:.2f}' for s in accepted['draft_lengths'])}, draft rate "
                     f"{accepted['draft_rate']:.2f}; {drafted['steps']} steps with drafts: engine "
                     f"{drafted['engine_s']:.2f}s, profile {drafted['profile_s']:.2f}s ({error})")
        lines.append(f"{'speed-up':20}{'engine':>10}{'simulator':>11}{'error':>9}")
        for name, row in data["speedup"].items():
            error = "n/a" if row["relative_error"] is None else f"{row['relative_error']:+.1%}"
            lines.append(f"{name:20}{row['engine']:10.3f}{row['simulator']:11.3f}{error:>9}")
        for side, runs in data["figures"].items():
            lines.append(f"{side:10} " + "; ".join(
                f"{name} {r['throughput_tok_s']:.1f} tok/s, TPOT p50 {r['tpot_s']['p50'] * 1000:.1f} ms "
                f"p99 {r['tpot_s']['p99'] * 1000:.1f} ms" for name, r in runs.items()))
    return "\n".join(lines)


def overload_warning(trace, report: dict, instances: int) -> str | None:
    """A warning when arrivals outran the fleet: the run lasted well past the arrivals' span and the
    median request waited a tenth of that span for its first token, so TTFT measures the queue."""
    span = trace[-1].arrival - trace[0].arrival if trace else 0.0
    factor = report["simulated_s"] / span if span > 0 else 0.0
    if factor < OVERLOAD_FACTOR or report["ttft_s"]["p50"] < 0.1 * span:
        return None
    return (f"warning: arrivals exceed what {instances} engine{'s' if instances > 1 else ''} can serve: the run "
            f"lasted {report['simulated_s']:,.0f} s for {span:,.0f} s of arrivals ({factor:.1f}x), so TTFT mostly "
            f"measures the queue; try --instances {min(math.ceil(instances * factor), len(trace))} (or --time-scale "
            f"{factor:.1f} for this fleet at a rate it sustains)")


def write_json(path: Path | None, report: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")


def parse_sweep(text: str) -> tuple[str, list[int | None]]:
    name, _, values = text.partition("=")
    name = name.strip().replace("-", "_").removeprefix("__")
    if name not in CAPACITIES or not values:
        raise ValueError(f"--sweep takes PARAM=A,B,C with PARAM one of {', '.join(CAPACITIES)}, not {text!r}")
    return name, [tokens(v) for v in values.split(",")]


def simulate(trace, config: SimConfig, cost: CostModel, label: str = "") -> SimResult:
    bar = Progress(label) if sys.stderr.isatty() else None
    try:
        return Simulator(trace, config, cost, progress=bar).run()
    finally:
        if bar is not None:
            bar.close()


def headline(report: dict, prefix: str = "") -> str:
    hits = report["hit_rate"]
    return (f"{prefix}{report['requests']} requests | hit rate {hits['total']:.3f} (device {hits['device']:.3f}, "
            f"host {hits['host']:.3f}, store {hits['store']:.3f}; ideal {report['ideal_hit_rate']:.3f}) | "
            f"TTFT p50 {report['ttft_s']['p50']:.3f}s p90 {report['ttft_s']['p90']:.3f}s | TPOT p50 "
            f"{report['tpot_s']['p50'] * 1000:.1f}ms | {report['throughput_tok_s']:.0f} tok/s | "
            f"{report['preemptions']} preemptions | {report['wall_s']:.1f}s wall")


class Progress:
    """A one-line progress bar on stderr, redrawn at most 10 times a second."""

    def __init__(self, label: str = ""):
        self.label = label
        self.started = time.perf_counter()
        self._drawn = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self._drawn < 0.1 and done < total:
            return
        self._drawn = now
        filled = math.floor(30 * done / total)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} requests "
                         f"{now - self.started:.0f}s")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
