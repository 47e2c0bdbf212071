"""What a profile was fitted on, and the refusal to validate on it.

A calibrated profile names the trace slices it was fitted on (`CostModel.fitted_on`: the trace's
digest and the lines used); a validation slice that shares a request with them is refused: that
would measure the fit, not the model. It also names the path its engine ran (`machine["runs"]`:
weight format, dtype, step path, the kernels' ISA level; `machine["threads"]`), and a validation
whose engine runs another path is refused: a cost model fitted to one path does not carry to another
(the Python loop's cost grows with operators, the fused layers' with bytes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from kvstrata.sim.cost_model import CostModel


class FittedOnError(ValueError):
    """The profile was fitted on requests of this slice: validating on them would measure the fit."""


def trace_digest(path: str | Path) -> str:
    """sha256 of the trace file: names its content, wherever it lies."""
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        for part in iter(lambda: data.read(1 << 20), b""):
            digest.update(part)
    return digest.hexdigest()


def slice_identity(path: str | Path, name: str, lines: list[int]) -> dict:
    """What `fitted_on` records of a trace slice: the trace's digest and the lines (as ranges) used."""
    ranges: list[list[int]] = []
    for line in sorted(lines):
        if ranges and ranges[-1][1] == line:
            ranges[-1][1] = line + 1
        else:
            ranges.append([line, line + 1])
    return {"kind": "trace", "slice": name, "trace": Path(path).name, "sha256": trace_digest(path), "lines": ranges}


def check_not_fitted_on(cost: CostModel, identity: dict) -> None:
    """Refuse a validation on requests the profile was fitted on."""
    mine = {line for a, b in identity["lines"] for line in range(a, b)}
    for fitted in cost.fitted_on:
        if fitted.get("kind") != "trace" or fitted.get("sha256") != identity["sha256"]:
            continue
        shared = mine & {line for a, b in fitted["lines"] for line in range(a, b)}
        if shared:
            raise FittedOnError(f"the profile was fitted on {len(shared)} of this slice's {len(mine)} requests "
                                f"({fitted['trace']}, slice {fitted.get('slice')!r}, lines {fitted['lines']}); "
                                "a validation needs requests it never saw: pick another --skip or slice")


def engine_path(runs: Mapping[str, str], threads: int) -> dict[str, str]:
    """What a profile records of the path its engine ran, and what a validation's engine is held to."""
    return {**runs, "threads": str(threads)}


def check_same_path(cost: CostModel, path: Mapping[str, str]) -> None:
    """Refuse a validation whose engine runs another path than the profile was calibrated on (profiles
    calibrated before they recorded it are not checked)."""
    recorded = (cost.machine or {}).get("path")
    if recorded is None:
        return
    differ = [f"{key} {recorded.get(key)} there, {value} here" for key, value in path.items()
              if recorded.get(key) != value]
    if differ:
        raise FittedOnError(f"the profile was calibrated on another path than this engine runs ({'; '.join(differ)}): "
                            "calibrate with the flags the validation runs (--threads, --model) and validate again")


def check_same_clock(cost: CostModel, clock: str) -> None:
    """Refuse a validation timed by another clock than the profile's grid (profiles calibrated before they
    recorded it are not checked): with several threads a step's CPU time and its wall time differ ~2x."""
    recorded = next((f.get("clock") for f in cost.fitted_on if f.get("kind") == "grid"), None)
    if recorded is not None and recorded != clock:
        raise FittedOnError(f"the profile timed its steps by the {recorded} clock, this validation by the {clock} "
                            f"clock: validate with --clock {recorded}")
