"""Calibration and validation: shrunk and session slices, what a profile was fitted on and
validation's refusal of it, how the real engine is timed, and validation end to end.

Fast tests use small synthetic traces and fakes; the end-to-end validation on the real engine is
marked slow. (The simulator's own fidelity, batch shapes and stand-ins, is tested in tests/sim.)
"""

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvstrata.calibration.engine_replay import ShapeRecorder, TransferWaits, fault_in_kv
from kvstrata.calibration.fitted_on import (
    FittedOnError,
    check_not_fitted_on,
    check_same_path,
    engine_path,
    slice_identity,
)
from kvstrata.calibration.slices import Slice, session_lines, spread_ties
from kvstrata.core.hashing import BlockHasher
from kvstrata.core.machine import machine as current_machine
from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from kvstrata.sim.cost_model import CostModel, Link
from kvstrata.sim.traces import TraceRequest, TraceTokens, shrink

BS = 16


# ---- shrunk traces and slices -------------------------------------------------------------------
def test_a_shrunk_trace_keeps_its_ids_and_hashes_like_the_block_hasher():
    trace = [TraceRequest(0.0, 6758, 5, tuple(range(14))), TraceRequest(1.0, 1024, 5, (0, 1))]
    small = shrink(trace, 32)
    assert [r.input_length for r in small] == [423, 64] and [r.hash_ids for r in small] == [r.hash_ids for r in trace]
    tokens = TraceTokens(BlockHasher.create(BS, "m"), tokens_per_id=32)
    for request in small:
        assert math.ceil(request.input_length / 32) == len(request.hash_ids)
        prompt = tokens.prompt(request)
        expected = []
        tokens.hasher.extend(expected, prompt)
        assert len(prompt) == request.input_length and tokens.block_hashes(request) == expected
    assert tokens.prompt(small[0])[:64] == tokens.prompt(small[1])          # ids 0, 1 give the same tokens
    with pytest.raises(ValueError, match="tokens per trace id"):
        TraceTokens(BlockHasher.create(64, "m"), tokens_per_id=32)


def test_session_lines_takes_whole_sessions_in_trace_order():
    ids = [(0, 1), (0, 5), (0, 1, 2), (0, 9), (0, 1, 2, 3), (0, 5, 6), (0, 7), (0, 5, 6, 8), (0, 1, 2, 3, 4)]
    # sessions: {0, 2, 4, 8} (ids 0 1 ...), {1, 5, 7} (0 5 ...); 3 and 6 share only the system prompt id 0
    assert session_lines(ids, 7) == [0, 1, 2, 4, 5, 7, 8]
    assert session_lines(ids, 4) == [0, 2, 4, 8]
    with pytest.raises(ValueError, match="only 7 requests"):
        session_lines(ids, 8)


def test_spread_ties_spreads_requests_with_one_stamp_until_the_next():
    trace = [TraceRequest(t, 10, 1, (i,)) for i, t in enumerate([0.0, 0.0, 0.0, 3.0, 3.0])]
    assert [r.arrival for r in spread_ties(trace)] == [0.0, 1.0, 2.0, 3.0, 4.5]


def test_sessions_slice_config_has_every_tier():
    config = Slice("s", sessions=True, tokens_per_id=32, device_cache_tokens=1536, host_cache_tokens=1024,
                   store=True).sim_config()
    assert config.tokens_per_id == 32 and config.host_cache_tokens == 1024 and config.store_cache_tokens is None


# ---- what a profile was fitted on ---------------------------------------------------------------
def _profile(fitted_on=(), machine: dict | None = None) -> CostModel:
    """A calibrated-looking profile, of this machine unless `machine` names another."""
    return CostModel(source="test", kv_bytes_per_token=1, host_link=Link(0.0, 1e12), store_link=Link(0.0, 1e12),
                     compute=(0.01, 0.001, 0.002, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), fitted_on=tuple(fitted_on),
                     machine=machine or {**current_machine().as_dict(), "dtype": "float32"})


def test_a_profile_of_another_cpu_is_named_by_simulate_and_refused_by_validate(tmp_path, capsys):
    from kvstrata.entrypoints.cli.main import main

    path = _trace(tmp_path / "t.jsonl")
    here = current_machine()
    elsewhere = {**here.as_dict(), "kind": "Some Xeon | 2 cores | avx2+fma+avx512f", "dtype": "bfloat16"}
    assert _profile().other_machine() is None
    assert "calibrated on Some Xeon | 2 cores | avx2+fma+avx512f in bfloat16" in _profile(machine=elsewhere).other_machine()
    unnamed = dataclasses.replace(_profile(), machine=None)
    assert "does not say which CPU" in unnamed.other_machine()
    profile = tmp_path / "p.json"
    _profile(machine=elsewhere).save(profile)
    assert CostModel.load(profile).machine == elsewhere
    assert main(["simulate", "--trace", str(path), "--profile", str(profile), "--device-cache-tokens", "4096",
                 "--output-json", str(tmp_path / "out.json")]) == 0
    assert "note: this profile was calibrated on Some Xeon" in capsys.readouterr().out
    code = main(["simulate", "--validate", "--trace", str(path), "--profile", str(profile), "--max-requests", "10"])
    assert code == 2 and "calibrate on this machine first" in capsys.readouterr().err


def _trace(path: Path, n: int = 30) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 40, "output_length": 3,
                                        "hash_ids": [i]}) + "\n" for i in range(n)))
    return path


def test_slice_identity_names_the_lines_as_ranges(tmp_path):
    identity = slice_identity(_trace(tmp_path / "t.jsonl"), "plain", [5, 6, 7, 9, 12, 13])
    assert identity["lines"] == [[5, 8], [9, 10], [12, 14]] and len(identity["sha256"]) == 64


def test_a_profile_refuses_slices_it_was_fitted_on(tmp_path):
    path = _trace(tmp_path / "t.jsonl")
    fitted = _profile([{"kind": "grid", "steps": 10}, slice_identity(path, "plain", list(range(10, 20)))])
    check_not_fitted_on(fitted, slice_identity(path, "plain", list(range(20, 30))))       # disjoint: fine
    with pytest.raises(FittedOnError, match="fitted on 1 of this slice's 5 requests"):
        check_not_fitted_on(fitted, slice_identity(path, "plain", list(range(15 + 4, 24))))
    other = _trace(tmp_path / "other.jsonl", 31)                                            # other content
    check_not_fitted_on(fitted, slice_identity(other, "plain", list(range(10, 20))))


def test_validate_refuses_a_fitted_on_slice_before_starting_an_engine(tmp_path, capsys):
    from kvstrata.entrypoints.cli.main import main

    path = _trace(tmp_path / "t.jsonl")
    profile = tmp_path / "p.json"
    _profile([slice_identity(path, "plain", list(range(0, 10)))]).save(profile)
    code = main(["simulate", "--validate", "--trace", str(path), "--profile", str(profile), "--skip", "5",
                 "--max-requests", "10"])
    assert code == 2 and "fitted on 5 of this slice's 10 requests" in capsys.readouterr().err


def test_a_profile_is_held_to_the_path_its_engine_ran(tmp_path, capsys):
    """Calibrate records weight format, dtype, step path, kernels and threads; a validation whose engine runs
    another path is refused (one fitted to the Python loop does not time the fused layers), one that never
    recorded its path is not checked."""
    from kvstrata.entrypoints.cli.main import main

    ran = engine_path({"quantization": "gguf", "dtype": "bfloat16", "step": "fused", "kernels": "avx512_bf16"}, 2)
    recorded = _profile(machine={**current_machine().as_dict(), "dtype": "bfloat16", "path": ran})
    check_same_path(recorded, ran)
    check_same_path(_profile(), {**ran, "threads": "1"})
    with pytest.raises(FittedOnError, match="step fused there, torch here; threads 2 there, 1 here"):
        check_same_path(recorded, {**ran, "threads": "1", "step": "torch"})
    path = _trace(tmp_path / "t.jsonl")
    profile = tmp_path / "p.json"
    _profile(machine={**current_machine().as_dict(), "dtype": "bfloat16", "path": {**ran, "threads": "7"}}).save(profile)
    code = main(["simulate", "--validate", "--trace", str(path), "--profile", str(profile), "--skip", "5",
                 "--max-requests", "10", "--threads", "1"])
    assert code == 2 and "threads 7 there, 1 here" in capsys.readouterr().err


def test_fitted_on_survives_the_profile_file(tmp_path):
    path = _trace(tmp_path / "t.jsonl")
    profile = _profile([{"kind": "grid", "steps": 3, "probe_s": 0.5}, slice_identity(path, "plain", [1, 2])])
    profile.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json").fitted_on == profile.fitted_on


# ---- timing the real engine: links, transfer waits, warm pages ----------------------------------
def test_a_link_is_read_from_the_time_of_one_block_and_of_many():
    from kvstrata.calibration.calibrate import _link

    truth, size = Link(1e-4, 2e9), 368_640
    link = _link(truth.seconds(size), truth.seconds(32 * size), size)
    assert (link.latency_s, link.bandwidth) == pytest.approx((truth.latency_s, truth.bandwidth))


def test_a_step_that_ran_nothing_counts_the_wall_time_it_waited_for_transfers():
    now, asked = [10.0], []

    def wait_for_transfers(timeout: float) -> None:
        asked.append(timeout)
        now[0] += 0.25

    tiers = SimpleNamespace(wait_for_transfers=wait_for_transfers)
    waits = TransferWaits(tiers, clock=lambda: now[0])
    tiers.wait_for_transfers(timeout=0.005)
    tiers.wait_for_transfers(0.005)
    assert waits.seconds == 0.5 and asked == [0.005, 0.005]


def test_fault_in_kv_maps_every_tier_through_the_shape_recorder_and_keeps_the_zeros():
    """KV buffers come from calloc: untouched pages are not resident until the first write, which
    would land in the first timed step. fault_in_kv maps them all (the mapping itself is tested in
    test_buffers) and changes no byte."""
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    caches = {tier: PagedKVCache(spec, (64 << 20) // spec.bytes_per_block) for tier in ("device", "host")}
    engine = SimpleNamespace(runner=ShapeRecorder(SimpleNamespace(buffers=SimpleNamespace(caches=caches))))
    assert all(cache.unmapped_bytes > 0 for cache in caches.values())
    fault_in_kv(engine)
    assert all(cache.unmapped_bytes == 0 for cache in caches.values())
    assert all(int(cache.data.count_nonzero()) == 0 for cache in caches.values())


# ---- end to end on the real engine (slow) -------------------------------------------------------
@pytest.mark.slow
def test_validation_on_the_real_engine_reports_every_figure_per_tier(tmp_path):
    from kvstrata.calibration.validation import FIGURES, validate

    trace = Path(__file__).resolve().parents[3] / "shared/data/traces/conversation_trace.jsonl"
    if not trace.exists():
        pytest.skip("the conversation trace is not here")
    small = Slice("sessions", requests=8, sessions=True, tokens_per_id=32, max_input_tokens=256,
                  max_output_tokens=4, device_cache_tokens=512, host_cache_tokens=256, store=True)
    report = validate(trace, small, _profile(), threads=1, clock="cpu", time_scales={"given": 0.5})
    level = report["levels"]["given"]
    assert set(level["figures"]) == set(FIGURES)
    for name in ("hit_rate_device", "hit_rate_host", "hit_rate_store", "hit_rate_total"):
        row = level["figures"][name]
        assert row["engine"][0] == pytest.approx(row["simulator"], abs=0.05)
    assert level["engine_runs"][0]["loadavg_before"] and level["engine_runs"][0]["probe_s"] > 0


def test_validate_takes_the_newest_profile_of_this_machine(tmp_path, monkeypatch, capsys):
    from kvstrata.entrypoints.cli import calibrate as calibrate_cli
    from kvstrata.entrypoints.cli.main import main

    monkeypatch.setattr(calibrate_cli, "PROFILES", tmp_path)
    here = current_machine()
    elsewhere = {**here.as_dict(), "kind": "Some Xeon | 2 cores | avx2+fma+avx512f", "dtype": "bfloat16"}
    assert calibrate_cli.profile_for_this_machine() is None
    path = _trace(tmp_path / "t.jsonl")
    code = main(["simulate", "--validate", "--trace", str(path), "--max-requests", "10"])
    assert code == 2 and "no profile in benchmarks/profiles was calibrated on this machine" in capsys.readouterr().err
    _profile(fitted_on=[{"kind": "grid", "time": "2026-12-04T01:00:00+00:00"}], machine=elsewhere).save(tmp_path / "a.json")
    _profile(fitted_on=[{"kind": "grid", "time": "2026-12-02T01:00:00+00:00"}]).save(tmp_path / "b.json")
    _profile(fitted_on=[{"kind": "grid", "time": "2026-12-03T01:00:00+00:00"}]).save(tmp_path / "c.json")
    assert calibrate_cli.profile_for_this_machine() == tmp_path / "c.json"
    assert calibrate_cli.machine_profile_path().parent == tmp_path
    assert str(here.cores) + "core" in calibrate_cli.machine_profile_path().name
    # A profile of another model on this machine is never taken for SmolLM2's, nor the reverse.
    one_b = {**here.as_dict(), "dtype": "bfloat16", "model": "llama-3.2-1b"}
    _profile(fitted_on=[{"kind": "grid", "time": "2026-12-05T01:00:00+00:00"}], machine=one_b).save(tmp_path / "d.json")
    assert calibrate_cli.profile_for_this_machine() == tmp_path / "c.json"
    assert calibrate_cli.profile_for_this_machine("llama-3.2-1b") == tmp_path / "d.json"
    assert calibrate_cli.machine_profile_path("llama-3.2-1b").name.endswith("-llama-3.2-1b.json")
