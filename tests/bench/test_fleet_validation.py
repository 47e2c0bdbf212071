"""`kvstrata simulate --validate --prefill-instances P --decode-instances D`: the simulator's pooled figures,
the comparison rows, the refusals, and (slow) real fleets of processes on this machine, end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from kvstrata.bench.fleet_validation import (
    FIGURES,
    apart,
    compare,
    comparison_table,
    engine_like_config,
    fleet_trace,
    pooled,
    read_slices,
    simulate_slices,
)
from kvstrata.bench.fleets import FleetSpec
from kvstrata.core.machine import machine as current_machine
from kvstrata.sim.cost_model import CostModel
from kvstrata.sim.disaggregated import DisaggregatedSimulator

PROFILE = Path(__file__).resolve().parents[2] / "benchmarks/profiles/cpu-2core-zen5-smollm2-redis.json"


def _this_machines(path: Path) -> Path:
    """The shipped profile, saved as if calibrated here (validation refuses another machine's)."""
    here = {**current_machine().as_dict(), "dtype": "bfloat16"}
    dataclasses.replace(CostModel.load(PROFILE), machine=here).save(path)
    return path


def _trace(path: Path, copies: int = 2) -> Path:
    """Per copy: two short prompts with 6-token replies and one 700-token prompt, copies a minute apart,
    every prompt its own hash ids."""
    lines, next_id = [], 1
    for copy in range(copies):
        for at, length, output in ((0, 40, 6), (300, 700, 2), (600, 60, 6)):
            count = -(-length // 512)
            lines.append({"timestamp": copy * 60_000 + at, "input_length": length, "output_length": output,
                          "hash_ids": list(range(next_id, next_id + count))})
            next_id += count
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_simulated_fleets_get_the_warm_up_and_the_slices_one_after_another_and_pool_them(tmp_path):
    cost = CostModel.load(PROFILE)
    config = dataclasses.replace(engine_like_config(cost, "kv_aware", 0, host_cores=2, serving_overhead=0.3),
                                 audit=True)
    trace = _trace(tmp_path / "t.jsonl")
    fed = fleet_trace(read_slices(trace, 3, 2), warmups=2, gap_s=600.0)
    assert [(r.arrival, r.input_length, r.output_length) for r in fed] == [
        (0.0, 32, 8), (0.0, 32, 8), (600.0, 40, 6), (600.3, 700, 2), (600.6, 60, 6),
        (1200.0, 40, 6), (1200.3, 700, 2), (1200.6, 60, 6)]
    assert len({r.hash_ids for r in fed}) == len(fed)          # the warm-up shares no block with the slices
    both = simulate_slices(trace, 3, 2, config, cost, 1, 1)
    assert set(both) == {"disaggregated", "colocated"} and all(f["requests"] == 6 for f in both.values())
    result = DisaggregatedSimulator(fed, config, cost, 1, 1).run()
    assert apart(result, 2, 3, 2)
    audit = result.to_json()["audit"]        # every simulated step audited; nothing held at the end
    assert audit["steps_audited"] > 0 and audit["device_used_at_end"] == audit["device_in_flight_at_end"] == 0
    figures = pooled(result, 2, 3, 2)
    assert figures == both["disaggregated"]
    ttft = [1000 * record.ttft for record in result.records[2:]]
    assert figures["ttft_ms"]["p99"] == pytest.approx(np.percentile(ttft, 99))
    assert len(result.itl) == 2 * 7 + 2 * (5 + 1 + 5)            # the warm-up's 14 gaps are left out of the ITL
    assert figures["itl_ms"]["p99"] == pytest.approx(np.percentile(np.frombuffer(result.itl)[14:] * 1000, 99))
    # throughput over the two slices' spans, not over the ten minutes between them
    spans = [max(r.finish for r in part) - min(r.arrival for r in part)
             for part in (result.records[2:5], result.records[5:])]
    assert figures["output_throughput"] == pytest.approx(28 / sum(spans)) and sum(spans) < 30
    with pytest.raises(ValueError, match="3 repeats of 3 need 9"):
        simulate_slices(trace, 3, 3, config, cost, 1, 1)


def test_slices_that_would_overlap_are_spaced_further_apart(tmp_path, monkeypatch):
    from kvstrata.bench import fleet_validation

    cost = CostModel.load(PROFILE)
    config = engine_like_config(cost, "kv_aware", 0)
    trace = _trace(tmp_path / "t.jsonl")
    close = DisaggregatedSimulator(fleet_trace(read_slices(trace, 3, 2), warmups=2, gap_s=0.5), config, cost, 1,
                                   1).run()
    assert not apart(close, 2, 3, 2)       # the 700-token prompt's slice is still running half a second later
    spaced = simulate_slices(trace, 3, 2, config, cost, 1, 1)
    monkeypatch.setattr(fleet_validation, "SLICE_GAP_S", 0.5)
    retried = simulate_slices(trace, 3, 2, config, cost, 1, 1)     # 0.5 s, 2 s, then 8 s apart: the same figures
    def flat(figures: dict) -> dict:
        return {(kind, key, stat): value for kind, fleet in figures.items() for key, stats in fleet.items()
                for stat, value in (stats.items() if isinstance(stats, dict) else [("", stats)])}

    assert flat(retried) == pytest.approx(flat(spaced), rel=1e-9)


def test_the_comparison_gives_each_fleet_and_the_ratio_its_error():
    def figures(ttft: float, tpot: float, itl: float, tok_s: float) -> dict:
        return {"ttft_ms": {"p50": ttft, "p99": 2 * ttft}, "tpot_ms": {"p99": tpot}, "itl_ms": {"p99": itl},
                "output_throughput": tok_s}

    measured = {"disaggregated": figures(300, 50, 100, 60), "colocated": figures(200, 100, 400, 80)}
    simulated = {"disaggregated": figures(330, 40, 100, 60), "colocated": figures(200, 100, 200, 80)}
    rows = compare(measured, simulated)
    assert [row["figure"] for row in rows] == [label for label, _, _ in FIGURES]
    ttft = rows[0]
    assert ttft["measured"] == [300, 200, 1.5] and ttft["error"] == pytest.approx([0.1, 0.0, 0.1])
    assert rows[2]["error"] == pytest.approx([-0.2, 0.0, -0.2]) and rows[3]["error"] == pytest.approx([0.0, -0.5, 1.0])
    table = comparison_table({"split": "1P+1D", "engines": 2, "rows": rows})
    assert "2 colocated" in table and "-50.0%" in table
    assert table.endswith("within 10%: 11 of 15 (the fleets' own figures 8 of 10)")


def test_a_fleet_spec_names_its_engines_roles_and_router_flags():
    pd = FleetSpec("disaggregated", prefill=1, decode=2, local_prefill_tokens=512, port=19000)
    assert pd.roles == ["prefill", "decode", "decode"]
    assert pd.router_flags() == ["--pd-disaggregation", "--policy", "kv_aware", "--prefill", "http://127.0.0.1:19001",
                                 "--decode", "http://127.0.0.1:19002", "--decode", "http://127.0.0.1:19003",
                                 "--local-prefill-tokens", "512"]
    colocated = dataclasses.replace(pd, kind="colocated")
    assert colocated.roles == ["both"] * 3 and colocated.router_flags()[:2] == ["--policy", "kv_aware"]
    with pytest.raises(ValueError, match="one of disaggregated, colocated"):
        FleetSpec("split")
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        FleetSpec("disaggregated", prefill=0)


@pytest.mark.slow     # 8 s: three processes start, two of them exit
def test_a_fleet_whose_engine_cannot_start_fails_at_once_and_leaves_nothing_running(tmp_path, monkeypatch):
    """`--threads 0` makes each `kvstrata serve` exit at start-up: the run says so, and every process it
    started (Redis, the engines, the router) is stopped, which `stop` is seen doing to each."""
    from kvstrata.bench import fleets

    stopped, original = [], fleets.stop

    def watched(processes) -> None:
        stopped.extend(processes)
        original(processes)

    monkeypatch.setattr(fleets, "stop", watched)
    with pytest.raises(RuntimeError, match="exited during start-up"):
        fleets.run_fleet(FleetSpec("disaggregated", threads=0, port=18700), _trace(tmp_path / "t.jsonl"), 3, 6,
                         tmp_path)
    assert len(stopped) == 4 and all(process.poll() is not None for process in stopped)


def test_validating_a_split_needs_both_counts_and_no_sweep(tmp_path, capsys):
    from kvstrata.entrypoints.cli.main import main

    profile = _this_machines(tmp_path / "p.json")
    trace = _trace(tmp_path / "t.jsonl")
    base = ["simulate", "--validate", "--trace", str(trace), "--profile", str(profile)]
    assert main([*base, "--prefill-instances", "1"]) == 2
    assert "give --prefill-instances and --decode-instances together" in capsys.readouterr().err
    assert main([*base, "--prefill-instances", "1", "--decode-instances", "1", "--sweep", "host_cache_tokens=0"]) == 2
    assert "neither --speculative-config, --sweep nor --pd-splits" in capsys.readouterr().err
    assert main([*base, "--prefill-instances", "1", "--decode-instances", "1", "--repeat", "7"]) == 2
    assert "fewer than --repeat 7" in capsys.readouterr().err
    assert main([*base, "--prefill-instances", "1", "--decode-instances", "1", "--time-scale", "2"]) == 2
    assert "replays the trace as written: --time-scale not taken" in capsys.readouterr().err


@pytest.mark.slow
def test_a_real_split_and_colocated_fleet_are_measured_beside_the_simulator(tmp_path, capsys):
    """Real processes: Redis, two engines and a router per fleet, driven by `kvstrata bench serve`."""
    from kvstrata.entrypoints.cli.main import main

    profile = _this_machines(tmp_path / "p.json")
    trace = _trace(tmp_path / "t.jsonl", copies=1)
    out = tmp_path / "report.json"
    assert main(["simulate", "--validate", "--trace", str(trace), "--profile", str(profile), "--prefill-instances",
                 "1", "--decode-instances", "1", "--router", "kv_aware", "--output-json", str(out)]) == 0
    assert "within 10%:" in capsys.readouterr().out
    report = json.loads(out.read_text())
    pd, colocated = report["fleets"]["disaggregated"], report["fleets"]["colocated"]
    assert pd["summary"]["completed"] == colocated["summary"]["completed"] == 3
    assert pd["router"]['kvstrata_router_handoffs_total{outcome="handed_over"}'] >= 3   # and the warm-up's
    assert colocated["router"].get("kvstrata_router_handed_over_tokens_total", 0) == 0
    assert pd["cpu_s"]["prefill0"] > 0 and pd["cpu_s"]["decode1"] > 0 and colocated["cpu_s"]["both0"] > 0
    assert all(len(row["measured"]) == 3 and all(m > 0 for m in row["measured"]) for row in report["rows"])
