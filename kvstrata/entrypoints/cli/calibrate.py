"""`kvstrata calibrate`: fit the simulator's cost model to the real engine on this machine, then check it.

    kvstrata calibrate --trace T                                              fit a profile on this machine
                                                                              (benchmarks/profiles/, named by it)
                                                                              and validate it on T's plain slice
    kvstrata calibrate --trace T --check-slices plain,sessions                 ... and with the host tier and store
    kvstrata calibrate --trace T --fit-slices plain --check-slices sessions   fit a slice too (then refused)
    kvstrata calibrate --repeat 1 --store redis://127.0.0.1:6390/0 --output p.json     the store link of a Redis
    kvstrata calibrate --load-format dummy --model llama-3.2-1b                 a real shape (dummy weights)

The engine it times is the one `kvstrata serve` runs: the same default dtype, weight format, step path
and thread count (the profile records them, and `simulate --validate` refuses another path). The grid
runs until the fit stops moving or the --budget would be passed, keeping the self-check's time.
How the engine is run and timed (`add_engine_timing`) is shared with `kvstrata simulate --validate`,
which must time it the same way.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROFILES = Path("benchmarks/profiles")
DEFAULT_MODEL = "SmolLM2-135M-Instruct"      # what profiles written before they named their model were fitted to


def machine_profile_path(model: str = DEFAULT_MODEL) -> Path:
    """Where `calibrate` writes this machine's profile of `model` by default: named by its CPU, cores and
    ISA, so a profile fitted on another CPU is never overwritten nor taken for this one's."""
    from kvstrata.core.machine import machine as current_machine

    here = current_machine()
    isa = "-".join(flag.replace("_", "") for flag in here.isa if flag not in ("avx2", "fma")) or "avx2"
    cpu = "-".join(here.cpu.lower().split()[:2])
    name = "smollm2" if model == DEFAULT_MODEL else model.lower()
    return PROFILES / f"{cpu}-{here.cores}core-{isa}-{name}.json"


def profile_for_this_machine(model: str = DEFAULT_MODEL) -> Path | None:
    """The newest profile of `model` in benchmarks/profiles calibrated on a machine of this kind (CPU,
    cores, ISA: `CostModel.other_machine`), or None: what `simulate --validate` times the engine against
    when no --profile is given."""
    from kvstrata.core.machine import machine as current_machine

    kind, found = current_machine().kind, []
    for path in PROFILES.glob("*.json"):
        try:
            profile = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        fitted = profile.get("machine") or {}
        if fitted.get("kind") == kind and fitted.get("model", DEFAULT_MODEL) == model:
            found.append((max((f.get("time", "") for f in profile.get("fitted_on", ())), default=""), path.name, path))
    return max(found)[2] if found else None


def add_engine_timing(group: argparse._ActionsContainer) -> None:
    """How the real engine is run and timed: `calibrate` and `simulate --validate` must agree on both."""
    group.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads of the real engine (default: torch's choice, as `kvstrata serve` "
                            "runs; the profile records it and a validation must run the same)")
    group.add_argument("--clock", choices=("cpu", "wall"), default=None,
                       help="time engine steps by the engine thread's CPU time (neighbours on a shared machine do "
                            "not count) or by wall time (default: cpu with one thread, wall with more: one "
                            "thread's CPU time misses the work of the others)")


def engine_timing(args: argparse.Namespace) -> tuple[int | None, str]:
    """--threads and --clock as the engine will run: the clock, when not named, by the thread count (with two
    threads the engine thread's CPU time was half a step's wall time on a 2-core EPYC, so a profile timed
    by it predicted half the latency the server has)."""
    if args.clock is not None:
        return args.threads, args.clock
    import torch

    return args.threads, "cpu" if (args.threads or torch.get_num_threads()) == 1 else "wall"


def add_calibrate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("calibrate", help="fit the simulator's cost model to the real engine on "
                                                   "this machine")
    parser.add_argument("--output", type=Path, default=None, help="where to write the JSON profile (default: "
                        "benchmarks/profiles/CPU-CORES-ISA-smollm2.json, named after this machine)")
    parser.add_argument("--machine", default=None, help="how to name this machine in the profile "
                                                        "(default: CPU model and core count)")
    add_engine_timing(parser)
    parser.add_argument("--repeat", type=int, default=3, help="runs of the grid at least; each step keeps its median "
                                                              "time, and more runs follow while the fit still moves")
    parser.add_argument("--budget", type=float, default=15.0, help="minutes the whole calibration may take, its "
                        "self-check included: no grid run starts that would pass it (at least --repeat run)")
    parser.add_argument("--check-slices", default="plain", help="comma-separated slices of --trace (plain, sessions: "
                        "the host tier and a disk store on) to validate the fresh profile on at three loads; "
                        "empty: no self-check")
    parser.add_argument("--store", default="disk", help="the store whose loads the profile's store link times: "
                                                        "disk (a disk store in the temp folder) or a running "
                                                        "store's URL, e.g. redis://127.0.0.1:6390/0 (the store "
                                                        "disaggregated engines hand KV over through)")
    parser.add_argument("--trace", type=Path, default=None, help="a Mooncake trace to check the profile on "
                                                                 "(--check-slices) and to fit --fit-slices of")
    parser.add_argument("--fit-slices", default="", help="comma-separated validation slices (plain, sessions) to "
                                                         "replay and fit too; validation then refuses them")
    parser.add_argument("--model", default=None, help="the model to fit (as `kvstrata serve --model`; default: the "
                                                      "embedded SmolLM2)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                        help="dummy: --model's real shape with random weights (llama-3.2-1b, ...): a profile of a "
                             "model whose weights are not here, for `kvstrata simulate --profile`")
    parser.set_defaults(run=run_calibrate, default_log_level="INFO")     # minutes of work: say each step


def run_calibrate(args: argparse.Namespace) -> int:
    import time

    from kvstrata.calibration.calibrate import calibrate
    from kvstrata.calibration.self_check import PLANNED_REPLAYS, check_slices, replays_within, seconds_for, self_check
    from kvstrata.calibration.slices import SLICES
    from kvstrata.calibration.validation import validation_table

    started = time.perf_counter()
    slices = tuple(name for name in args.fit_slices.split(",") if name)
    if set(slices) - set(SLICES):
        raise ValueError(f"--fit-slices takes names of {', '.join(SLICES)}, not {args.fit_slices!r}")
    if args.trace is not None and (args.model or args.load_format != "auto"):
        raise ValueError("--trace replays slices on the default model only; drop --model / --load-format")
    checks = check_slices(args.check_slices, slices) if args.trace is not None else ()
    if args.trace is None:
        print("no --trace: the profile will not be checked against the engine (`kvstrata calibrate --trace T` "
              "ends with `simulate --validate` on its plain slice)")
    end = started + args.budget * 60
    threads, clock = engine_timing(args)

    def deadline(fit_so_far) -> float:
        return end - PLANNED_REPLAYS * seconds_for(args.trace, checks, fit_so_far) if checks else end

    calibration = calibrate(threads=threads, repeat=args.repeat, machine=args.machine, clock=clock,
                            trace=args.trace, slices=slices, store=args.store, model=args.model,
                            load_format=args.load_format, deadline=deadline)
    output = args.output or machine_profile_path(calibration.model.machine["model"])
    calibration.save(output)
    print(calibration.report())
    print(f"profile written to {output}: {calibration.model.source}", flush=True)
    if checks:
        each = seconds_for(args.trace, checks, calibration.model)
        replays = replays_within(end - time.perf_counter(), each)
        print(f"\nself-check: {', '.join(checks)} at three loads, the engine {replays} time(s) "
              f"(~{replays * each / 60:.0f} min)", flush=True)
        for check in self_check(args.trace, checks, calibration.model, threads, clock, replays):
            print(f"\nself-check on slice {check.name!r} of {args.trace} (not fitted on):")
            print(validation_table(check.report), flush=True)
    print(f"\ncalibrate took {(time.perf_counter() - started) / 60:.1f} min (budget {args.budget:g})")
    return 0
