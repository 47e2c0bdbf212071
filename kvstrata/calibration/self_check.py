"""`kvstrata calibrate`'s last step: the fresh profile validated on slices it was not fitted on.

A profile is worth what `simulate --validate` says of it, and a user calibrating on their own machine
should not have to know to ask. So `calibrate` ends by replaying each named slice of the trace at the
three loads (`validation.validate`, the engine the profile was fitted on: same model, threads and
clock) and prints the tables and, per slice, how many of its 15 timing figures came within 5%.

Its time is planned before the grid ends: `seconds_for` prices a slice's replays with the fit so far,
so `calibrate` runs more grid passes only while PLANNED_REPLAYS of them still fit its budget, and then
replays the engine as often as the time left allows (`replays_within`): on a 2-core VM the same replay
ran 5-15% faster or slower from one run to the next with two threads, and the verdict is against
the mean of the runs, their spread printed beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvstrata.calibration.slices import SLICES, offered_work
from kvstrata.calibration.validation import LOADS, Verdict, validate, verdict
from kvstrata.sim.cost_model import CostModel

ENGINE_START_S = 4.0         # building an engine, warming it and its speed probe, per load (measured: 3-5 s)
PLANNED_REPLAYS = 2          # the grid leaves time for two: one engine run cannot tell noise from the model
MOST_REPLAYS = 3


@dataclass(frozen=True)
class SliceCheck:
    name: str
    report: dict
    verdict: Verdict


def seconds_for(trace: str | Path, names: tuple[str, ...], cost: CostModel) -> float:
    """What replaying `names` once at every load will take, as `cost` prices it: each load's engine run is
    busy for about the slice's offered work (served one at a time; batching only shortens it; idle gaps
    are skipped), plus its start."""
    total = 0.0
    for name in names:
        requests, _ = SLICES[name].load(trace)
        total += len(LOADS) * (offered_work(requests, cost, SLICES[name].tokens_per_id) + ENGINE_START_S)
    return total


def self_check(trace: str | Path, names: tuple[str, ...], cost: CostModel, threads: int | None, clock: str,
               repeat: int = 1) -> list[SliceCheck]:
    """Each slice of `names` at the three loads against `cost`, the engine replayed `repeat` times (the
    verdict takes their mean; their spread is the machine's noise). A slice `cost` was fitted on is refused
    before anything runs (`validation.validate`)."""
    checks = []
    for name in names:
        report = validate(trace, SLICES[name], cost, threads, clock, repeat=repeat)
        checks.append(SliceCheck(name, report, verdict(report)))
    return checks


def replays_within(seconds_left: float, seconds_each: float, most: int = MOST_REPLAYS) -> int:
    """How many replays of the self-check fit the time left: at least one, at most `most`."""
    return max(1, min(most, int(seconds_left // seconds_each))) if seconds_each > 0 else 1


def check_slices(names: str, fitted: tuple[str, ...]) -> tuple[str, ...]:
    """--check-slices parsed: known slices, none of them fitted on (that would grade the fit on itself)."""
    chosen = tuple(name for name in names.split(",") if name)
    unknown = [name for name in chosen if name not in SLICES or name == "speculative"]
    if unknown:
        raise ValueError(f"--check-slices takes plain and sessions, not {', '.join(unknown)}")
    if set(chosen) & set(fitted):
        raise ValueError(f"--check-slices {','.join(sorted(set(chosen) & set(fitted)))} is also in --fit-slices: "
                         "a profile cannot be validated on what it was fitted on")
    return chosen

