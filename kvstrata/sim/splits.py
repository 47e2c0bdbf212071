"""P:D splits of a fleet against as many colocated engines, and which to run under an SLO.

`kvstrata simulate --pd-splits 1:3,2:2,3:1` replays the trace through each disaggregated split
(`DisaggregatedSimulator`) and through colocated fleets of each size, and with an SLO
(`--slo-ttft-ms`, `--slo-tpot-ms`) recommends, per fleet size, the layout whose requests meet it
most often: the share of requests with TTFT and TPOT within the SLO (DistServe's SLO attainment,
which a throughput or a percentile alone hides: a split can halve TPOT p99 while every request
waits twice as long for its first token). Ties go to the lower TTFT p99, then TPOT p99. Colocated
fleets compete too: where they meet the SLO as often, disaggregation is not worth its handoffs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvstrata.sim.config import SimConfig
from kvstrata.sim.cost_model import CostModel
from kvstrata.sim.disaggregated import DisaggregatedSimulator
from kvstrata.sim.results import RequestRecord, SimResult
from kvstrata.sim.simulator import Simulator
from kvstrata.sim.traces import TraceRequest


@dataclass(frozen=True)
class Slo:
    """Per-request targets (seconds; None: not a target). A one-token reply has no TPOT to miss."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for value in (self.ttft_s, self.tpot_s):
            if value is not None and value <= 0:
                raise ValueError(f"an SLO target must be positive, not {value}")

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def met_by(self, record: RequestRecord) -> bool:
        ttft_ok = self.ttft_s is None or record.ttft <= self.ttft_s
        tpot = record.tpot
        return ttft_ok and (self.tpot_s is None or math.isnan(tpot) or tpot <= self.tpot_s)

    def attainment(self, records: list[RequestRecord]) -> float:
        return sum(self.met_by(r) for r in records) / len(records) if records else 0.0

    def describe(self) -> str:
        parts = [f"TTFT <= {self.ttft_s * 1000:g} ms" if self.ttft_s is not None else "",
                 f"TPOT <= {self.tpot_s * 1000:g} ms" if self.tpot_s is not None else ""]
        return " and ".join(p for p in parts if p)


@dataclass
class Layout:
    """One fleet replayed: `prefill` and `decode` engines (prefill 0: `decode` colocated engines)."""

    prefill: int
    decode: int
    result: SimResult

    @property
    def engines(self) -> int:
        return self.prefill + self.decode

    @property
    def label(self) -> str:
        return f"{self.prefill}P+{self.decode}D" if self.prefill else f"{self.decode} colocated"

    def figures(self, slo: Slo) -> dict:
        out = {"layout": self.label, "prefill_instances": self.prefill, "decode_instances": self.decode,
               **self.result.to_json()}
        if slo.given:
            out["slo_attainment"] = slo.attainment(self.result.records)
        return out


def parse_splits(text: str) -> list[tuple[int, int]]:
    """'1:3,2:2' -> [(1, 3), (2, 2)]: prefill:decode engines, each at least 1."""
    splits = []
    for item in text.split(","):
        prefill, sep, decode = item.strip().partition(":")
        if not sep or not prefill.isdigit() or not decode.isdigit() or int(prefill) < 1 or int(decode) < 1:
            raise ValueError(f"--pd-splits takes P:D pairs of positive counts, e.g. 1:3,2:2, not {text!r}")
        splits.append((int(prefill), int(decode)))
    return splits


def replay_layouts(trace: list[TraceRequest], config: SimConfig, cost: CostModel,
                   splits: list[tuple[int, int]]) -> list[Layout]:
    """Each split, then a colocated fleet of each size the splits have (`config.router` over it)."""
    layouts = [Layout(p, d, DisaggregatedSimulator(trace, config, cost, p, d).run()) for p, d in splits]
    for size in sorted({p + d for p, d in splits}):
        layouts.append(Layout(0, size, Simulator(trace, dataclasses.replace(config, instances=size), cost).run()))
    return layouts


def recommend(layouts: list[Layout], slo: Slo) -> dict[int, Layout]:
    """Per fleet size, the layout (a split or colocated) whose requests meet `slo` most often."""
    assert slo.given, "a recommendation needs an SLO"
    best: dict[int, Layout] = {}
    for layout in layouts:
        current = best.get(layout.engines)
        if current is None or _rank(layout, slo) < _rank(current, slo):
            best[layout.engines] = layout
    return best


def _rank(layout: Layout, slo: Slo) -> tuple[float, float, float]:
    figures = layout.result.to_json()
    return -slo.attainment(layout.result.records), figures["ttft_s"]["p99"], figures["tpot_s"]["p99"]
