"""The simulator with speculative decoding: the acceptance it draws from, the real scheduler's draft
slots under every tier (audited), what a higher acceptance buys, nothing changed without drafts, and
the `kvstrata simulate --speculative-config` comparison."""

import dataclasses
import itertools
import json

import numpy as np
import pytest

from kvstrata.core.config import SpeculativeConfig
from kvstrata.sim.config import SimConfig
from kvstrata.sim.roofline import roofline
from kvstrata.sim.simulator import Simulator
from kvstrata.sim.speculation import Acceptance, SimulatedDrafts, speedup
from kvstrata.sim.traces import TraceRequest, read_mooncake
from tests.sim.test_simulator import _cli, fixed_cost, synthetic_trace

K4 = SpeculativeConfig.parse('{"num_speculative_tokens": 4}')


def decode_heavy_trace(n: int = 12, gap: float = 0.3) -> list[TraceRequest]:
    """Short prompts with long replies, a few streams at once: decoding is most of the work."""
    return [TraceRequest(i * gap, 200 + 37 * i, 120 + 9 * i, (1000 + i,)) for i in range(n)]


# ---- the acceptance -----------------------------------------------------------------------------
def test_acceptance_is_geometric_from_one_number_and_per_position_from_several():
    assert Acceptance.parse("0.5").per_position[:3] == (0.5, 0.25, 0.125)
    assert Acceptance.parse("0.9,0.6,0.3", draft_rate=0.8) == Acceptance((0.9, 0.6, 0.3), 0.8)
    assert Acceptance.measured(10, [8, 5, 0]).per_position == (0.8, 0.5, 0.0)
    for bad in ("0.5,0.7", "1.5", "x"):
        with pytest.raises(ValueError):
            Acceptance.parse(bad)
    with pytest.raises(ValueError, match="draft rate"):
        Acceptance((0.5,), draft_rate=2.0)
    with pytest.raises(ValueError, match="no step had drafts"):
        Acceptance.measured(0, [])


def test_drawn_accepted_lengths_follow_the_acceptance():
    """P(at least i + 1 accepted) drawn over 20,000 steps of 4 drafts is each position's acceptance."""
    acceptance = Acceptance((0.9, 0.7, 0.4, 0.1))
    drafts = SimulatedDrafts(acceptance, token=0, seed=1)
    counts = np.array([drafts.verify(4) for _ in range(20_000)])
    for position, want in enumerate(acceptance.per_position):
        assert (counts > position).mean() == pytest.approx(want, abs=0.015)
    assert counts.mean() == pytest.approx(acceptance.mean_accepted(4), abs=0.03)
    assert drafts.verify(2) <= 2                     # never more than were drafted
    report = drafts.report()
    assert report["num_drafts"] == 20_001 and len(report["accepted_per_pos"]) == 4


def test_short_drafts_keep_the_measured_acceptance():
    """Drafts of 1 to 4 tokens (s_i = P(at least i + 1 drafted)): the lengths drawn follow s, and
    P(at least i + 1 accepted) is still the measured a_i."""
    acceptance = Acceptance.measured(1000, [700, 400, 150, 50], drafted_per_pos=[1000, 800, 500, 200])
    assert acceptance.draft_lengths == (1.0, 0.8, 0.5, 0.2)
    drafts = SimulatedDrafts(acceptance, token=0, seed=2)
    lengths = np.array([len(drafts.propose(None, 4)) for _ in range(20_000)])
    accepted = np.array([drafts.verify(int(n)) for n in lengths])
    assert (accepted <= lengths).all()
    for position in range(4):
        assert (lengths > position).mean() == pytest.approx(acceptance.draft_lengths[position], abs=0.015)
        assert (accepted > position).mean() == pytest.approx(acceptance.per_position[position], abs=0.015)
    with pytest.raises(ValueError, match="more often than drafts reach it"):
        Acceptance((0.9, 0.6), draft_lengths=(1.0, 0.5))
    assert Acceptance.parse("0.5", draft_lengths="1,0.5").per_position[:3] == (0.5, 0.125, 0.0)


# ---- the real scheduler's draft slots -----------------------------------------------------------
def test_speculation_keeps_every_invariant_through_preemption_and_every_tier(tmp_path):
    """Small device and host tiers and a store, every step audited: drafts are taken and settled
    (rejections that give back a block among them), requests are preempted and load from the
    store, and at the end no block is held on any tier."""
    trace = read_mooncake(synthetic_trace(tmp_path / "t.jsonl", sessions=40, max_live=16), max_requests=120,
                          max_input_tokens=640, time_scale=0.1)
    trace = [dataclasses.replace(r, output_length=128) for r in trace]      # long replies: the device runs out
    acceptance = Acceptance.geometric(0.7, draft_lengths=(1.0, 0.9, 0.7, 0.5))
    config = SimConfig(block_size=16, device_cache_tokens=2048, host_cache_tokens=2048, store_cache_tokens=65536,
                       store_timeout=0.05, audit=True, speculative=K4, acceptance=acceptance)
    sim = Simulator(trace, config, roofline("a100", "llama3-8b"))
    seen = {"drafted": 0, "short_draft": 0, "all_rejected": 0, "some_rejected": 0, "block_returned": 0}
    for engine in sim.engines:
        tiers, settle = engine.tiers, engine.tiers.settle_drafts

        def counted(request, tiers=tiers, settle=settle):
            held = len(tiers.block_ids(request.request_id))
            settle(request)
            seen["block_returned"] += len(tiers.block_ids(request.request_id)) < held
        tiers.settle_drafts = counted
    verify = sim.drafts.verify

    def verified(num_drafts: int) -> int:
        accepted = verify(num_drafts)
        seen["drafted"] += 1
        seen["short_draft"] += num_drafts < 4
        seen["all_rejected"] += accepted == 0
        seen["some_rejected"] += 0 < accepted < num_drafts
        return accepted
    sim.drafts.verify = verified
    report = sim.run().to_json()
    assert all(seen.values()), seen
    assert report["preemptions"] > 0 and report["transfers"]["loaded_blocks"]["store"] > 0
    assert report["audit"]["steps_audited"] == report["steps"]
    assert {k: v for k, v in report["audit"].items() if k != "steps_audited"} == {
        "device_used_at_end": 0, "device_in_flight_at_end": 0, "host_used_at_end": 0, "host_in_flight_at_end": 0}
    assert report["speculation"]["num_drafts"] == seen["drafted"]
    assert report["output_tokens"] == sum(r.output_length for r in trace)


def test_a_higher_acceptance_predicts_a_larger_speedup():
    trace = decode_heavy_trace()
    cost = fixed_cost()                 # a step: 10 ms + 1 ms per prefill token (draft rows too) + 2 ms per decode
    plain = Simulator(trace, SimConfig(block_size=16), cost).run().to_json()
    gains = []
    for alpha in (0.2, 0.6, 0.75, 0.9, 0.97):
        config = SimConfig(block_size=16, speculative=K4, acceptance=Acceptance.geometric(alpha))
        gains.append(speedup(plain, Simulator(trace, config, cost).run().to_json()))
    for name in ("throughput", "tpot_p50"):
        values = [g[name] for g in gains[1:]]
        assert all(a < b for a, b in itertools.pairwise(values)) and values[-1] > 1.4, (name, values)
    # at 0.2 (under a quarter of the drafts accepted) requests stop drafting after a few steps: no gain, little loss
    assert 0.95 < gains[0]["throughput"] < 1.02


def test_without_drafts_the_replay_is_unchanged():
    """A speculative config whose lookups never find a draft replays exactly as no config does."""
    trace = decode_heavy_trace()
    plain = Simulator(trace, SimConfig(block_size=16), fixed_cost()).run()
    never = SimConfig(block_size=16, speculative=K4, acceptance=Acceptance((0.9,), draft_rate=0.0))
    result = Simulator(trace, never, fixed_cost()).run()
    assert [(r.first_token, r.finish) for r in result.records] == [(r.first_token, r.finish) for r in plain.records]
    assert result.to_json()["speculation"]["num_drafts"] == 0 and "speculation" not in plain.to_json()
    with pytest.raises(ValueError, match="without a speculative config"):
        SimConfig(acceptance=Acceptance((0.5,))).validate()


def test_disable_by_batch_size_stops_drafts_in_a_full_batch():
    trace = [TraceRequest(0.0, 64, 40, (i,)) for i in range(6)]             # six streams from the start
    spec = dataclasses.replace(K4, disable_by_batch_size=4)
    result = Simulator(trace, SimConfig(block_size=16, speculative=spec), fixed_cost()).run().to_json()
    lone = Simulator(trace[:3], SimConfig(block_size=16, speculative=spec), fixed_cost()).run().to_json()
    assert lone["speculation"]["num_drafts"] > 0
    # six streams draft only once fewer than four are left running
    assert result["speculation"]["num_drafts"] < 2 * lone["speculation"]["num_drafts"]


# ---- command line -------------------------------------------------------------------------------
def test_simulate_with_a_speculative_config_reports_what_it_buys(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 2000 * i, "input_length": 300, "output_length": 100,
                                        "hash_ids": [i]}) + "\n" for i in range(6)))
    out = tmp_path / "out.json"
    text = _cli("simulate", "--trace", str(path), "--block-size", "16", "--hardware", "a100", "--device-cache-tokens", "4096",
                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                "--spec-acceptance", "0.9,0.8,0.7", "--spec-draft-rate", "0.9", "--audit", "--output-json", str(out))
    assert "without speculation:" in text and "speculation (3 drafts): throughput x" in text
    report = json.loads(out.read_text())
    assert set(report) == {"without", "with", "speedup"} and report["speedup"]["tpot_p50"] > 1
    assert report["with"]["config"]["acceptance"]["draft_rate"] == 0.9
    assert report["with"]["audit"]["device_used_at_end"] == 0


def test_simulate_refuses_an_acceptance_without_a_speculative_config(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 30, "output_length": 3, "hash_ids": [0]}) + "\n")
    done = subprocess.run([sys.executable, "-m", "kvstrata", "simulate", "--trace", str(path), "--hardware", "a100",
                           "--spec-acceptance", "0.7"], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "need --speculative-config" in done.stderr
