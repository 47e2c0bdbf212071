"""`kvstrata simulate --prefill-instances P --decode-instances D`: the handoff through the store on the
virtual clock, with the real scheduler and tier manager on both sides."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstrata.sim.config import SimConfig
from kvstrata.sim.disaggregated import DisaggregatedSimulator
from kvstrata.sim.traces import TraceRequest, read_mooncake
from tests.sim.test_simulator import _cli, fixed_cost, synthetic_trace


def test_one_request_by_hand_is_prefilled_handed_over_and_decoded():
    """1024 prompt tokens in blocks of 256: the prefill engine computes them (1.034 s) and writes the 3
    blocks before the last token to the store; the decode engine looks them up and loads them (a
    store call each, 0.5 s), computes the last block (0.01 + 0.256 s) and decodes."""
    trace = [TraceRequest(0.0, 1024, 3, (1, 2))]
    config = SimConfig(block_size=256, store_cache_tokens=None, audit=True)
    result = DisaggregatedSimulator(trace, config, fixed_cost(), 1, 1).run()
    (record,) = result.records
    assert record.engine == 1 and record.cached_tokens == 768
    assert record.ttft >= 1.034 + 0.5 + 0.5 + 0.266
    prefill, decode = result.engines
    assert prefill["hit_tokens"]["store"] == 0 and decode["hit_tokens"]["store"] == 768
    assert decode["loaded_blocks"]["store"] == 3
    assert result.to_json()["audit"]["device_used_at_end"] == 0


@pytest.mark.parametrize("split", [(1, 1), (1, 3), (2, 2)])
def test_a_fleet_serves_every_request_and_holds_nothing_at_the_end(tmp_path, split):
    trace = read_mooncake(synthetic_trace(tmp_path / "t.jsonl", sessions=20), max_input_tokens=2048,
                          max_output_tokens=16)
    config = SimConfig(block_size=64, device_cache_tokens=16384, store_cache_tokens=None, router="kv_aware",
                       audit=True)
    result = DisaggregatedSimulator(trace, config, fixed_cost(), *split).run()
    report = result.to_json()
    assert report["requests"] == len(trace) and report["audit"]["steps_audited"] > 0
    assert report["audit"]["device_used_at_end"] == 0 and report["audit"]["device_in_flight_at_end"] == 0
    assert all(record.engine >= split[0] for record in result.records)         # every reply from a decode engine
    assert sum(e["hit_tokens"]["store"] for e in result.engines[split[0]:]) > 0
    assert report["hit_rate"]["total"] <= report["ideal_hit_rate"]      # the prefill engines' prefix hits only


def test_the_command_compares_a_split_with_as_many_colocated_engines(tmp_path):
    trace = synthetic_trace(tmp_path / "t.jsonl", sessions=10)
    out = tmp_path / "pd.json"
    stdout = _cli("simulate", "--trace", str(trace), "--block-size", "64", "--device-cache-tokens", "16384",
                  "--store-cache-tokens", "inf", "--max-input-tokens", "2048", "--max-output-tokens", "16",
                  "--hardware", "a100", "--prefill-instances", "1", "--decode-instances", "2", "--router", "kv_aware",
                  "--output-json", str(out))
    disaggregated, colocated = json.loads(out.read_text())["layouts"]
    assert disaggregated["prefill_instances"] == 1 and colocated["config"]["instances"] == 3
    assert "1P+2D" in stdout and "3 colocated" in stdout and "SLO" not in stdout


def test_itl_counts_the_decode_engines_tokens_only():
    """One request of 4 output tokens: the prefill engine's token is not sent on, so the ITL has the 3
    intervals between the decode engine's 4 tokens, one decode step (10 + 2 ms) each."""
    trace = [TraceRequest(0.0, 1024, 4, (1, 2))]
    result = DisaggregatedSimulator(trace, SimConfig(block_size=256, store_cache_tokens=None), fixed_cost(), 1, 1).run()
    assert len(result.itl) == 3 and result.itl.tolist() == pytest.approx([0.012] * 3)
    assert result.to_json()["itl_s"]["p99"] == pytest.approx(0.012)


def test_the_command_sweeps_splits_and_recommends_one_under_an_slo(tmp_path):
    trace = synthetic_trace(tmp_path / "t.jsonl", sessions=10)
    out = tmp_path / "splits.json"
    stdout = _cli("simulate", "--trace", str(trace), "--block-size", "64", "--device-cache-tokens", "16384",
                  "--store-cache-tokens", "inf", "--max-input-tokens", "2048", "--max-output-tokens", "16",
                  "--hardware", "a100", "--pd-splits", "1:2,2:1,1:1", "--router", "kv_aware",
                  "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--output-json", str(out))
    report = json.loads(out.read_text())
    labels = [layout["layout"] for layout in report["layouts"]]
    assert labels == ["1P+2D", "2P+1D", "1P+1D", "2 colocated", "3 colocated"]
    assert all(0 <= layout["slo_attainment"] <= 1 for layout in report["layouts"])
    assert set(report["recommended"]) == {"2", "3"}
    for size, label in report["recommended"].items():
        same_size = [layout for layout in report["layouts"]
                     if layout["prefill_instances"] + layout["decode_instances"] == int(size)]
        best = max(layout["slo_attainment"] for layout in same_size)
        assert next(layout for layout in same_size if layout["layout"] == label)["slo_attainment"] == best
        assert f"{size} engines, SLO TTFT <= 500 ms and TPOT <= 50 ms: run {label}" in stdout


@pytest.mark.parametrize("flags", [["--pd-splits", "1:1", "--prefill-instances", "1", "--decode-instances", "1"],
                                   ["--prefill-instances", "1"], ["--pd-splits", "1:0"], ["--pd-splits", "2"]])
def test_the_command_refuses_splits_it_cannot_replay(tmp_path, flags):
    trace = synthetic_trace(tmp_path / "t.jsonl", sessions=2)
    done = subprocess.run([sys.executable, "-m", "kvstrata", "simulate", "--trace", str(trace), "--hardware", "a100",
                           "--store-cache-tokens", "inf", *flags], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode != 0 and ("--pd-splits" in done.stderr or "--prefill-instances" in done.stderr)


@pytest.mark.parametrize("limit", [0, 600])
def test_prompts_a_decode_engine_nearly_holds_are_prefilled_there(limit):
    """A long first turn is handed over either way; a short prompt and the conversation's next turn (512
    tokens past what its decode engine holds) go through the prefill engine without a limit, and straight
    to the decode engine with one."""
    trace = [TraceRequest(0.0, 1024, 3, (1, 2)), TraceRequest(0.1, 200, 3, (3,)), TraceRequest(20.0, 1536, 3, (1, 2, 4))]
    config = SimConfig(block_size=256, store_cache_tokens=None, local_prefill_tokens=limit, audit=True)
    result = DisaggregatedSimulator(trace, config, fixed_cost(), 1, 1).run()
    first, short, second = result.records
    prefill, decode = result.engines
    assert first.engine == short.engine == second.engine == 1
    assert (first.cached_tokens, short.cached_tokens) == (768, 0)
    assert result.to_json()["audit"]["device_used_at_end"] == 0
    if limit:       # the next turn: the decode engine's own 1,024 tokens, the rest computed there
        assert (second.cached_tokens, prefill["hit_tokens"]["device"], decode["hit_tokens"]["store"]) == (1024, 0, 768)
    else:           # the prefill engine finds 1,024, computes and stores the rest; the decode engine loads a block
        assert (second.cached_tokens, prefill["hit_tokens"]["device"], decode["hit_tokens"]["store"]) == (1280, 1024, 1024)
