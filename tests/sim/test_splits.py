"""P:D splits under an SLO (kvstrata.sim.splits): the parsing, a request meeting the SLO, and the choice."""

from __future__ import annotations

import math

import pytest

from kvstrata.sim.results import RequestRecord
from kvstrata.sim.splits import Layout, Slo, parse_splits, recommend


def test_parse_splits_reads_pairs_and_refuses_anything_else():
    assert parse_splits("1:3, 2:2,3:1") == [(1, 3), (2, 2), (3, 1)]
    for text in ("1:0", "0:2", "2", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError, match="--pd-splits"):
            parse_splits(text)


def record(ttft: float, tpot: float, outputs: int = 11) -> RequestRecord:
    return RequestRecord(arrival=0.0, prompt_tokens=100, output_tokens=outputs, first_token=ttft,
                         finish=ttft + tpot * (outputs - 1))


def test_a_request_meets_the_slo_when_both_targets_hold_and_a_one_token_reply_has_no_tpot():
    slo = Slo(ttft_s=1.0, tpot_s=0.05)
    assert slo.met_by(record(0.9, 0.04))
    assert not slo.met_by(record(1.1, 0.04)) and not slo.met_by(record(0.9, 0.06))
    assert math.isnan(record(0.5, 9.0, outputs=1).tpot) and slo.met_by(record(0.5, 9.0, outputs=1))
    assert Slo(tpot_s=0.05).met_by(record(100.0, 0.04)) and not Slo().given
    assert slo.attainment([record(0.9, 0.04), record(1.1, 0.04)]) == 0.5
    with pytest.raises(ValueError):
        Slo(ttft_s=0.0)


class FakeResult:
    """What `recommend` reads of a SimResult: the records and the percentiles of to_json."""

    def __init__(self, records):
        self.records = records

    def to_json(self):
        ttft = sorted(r.ttft for r in self.records)
        tpot = sorted(r.tpot for r in self.records)
        return {"ttft_s": {"p99": ttft[-1]}, "tpot_s": {"p99": tpot[-1]}}


def test_recommend_takes_the_layout_that_meets_the_slo_most_often_per_fleet_size():
    slo = Slo(ttft_s=1.0, tpot_s=0.05)
    fast_first_token = [record(0.2, 0.08)] * 3 + [record(0.2, 0.04)]      # 1 of 4 meets it
    steady = [record(0.8, 0.04)] * 3 + [record(2.0, 0.04)]                # 3 of 4
    slower_tail = [record(0.7, 0.04)] * 3 + [record(3.0, 0.04)]           # 3 of 4, but a later TTFT p99
    layouts = [Layout(0, 4, FakeResult(fast_first_token)), Layout(2, 2, FakeResult(slower_tail)),
               Layout(1, 3, FakeResult(steady)), Layout(1, 1, FakeResult(fast_first_token)),
               Layout(0, 2, FakeResult(steady))]
    best = recommend(layouts, slo)
    assert {size: layout.label for size, layout in best.items()} == {4: "1P+3D", 2: "2 colocated"}
