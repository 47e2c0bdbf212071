"""What a profile was fitted on, and the refusal to validate on it.

A calibrated profile names the trace slices it was fitted on (`CostModel.fitted_on`: the trace's
digest and the lines used); a validation slice that shares a request with them is refused: that
would measure the fit, not the model.
"""

from __future__ import annotations

import hashlib
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
