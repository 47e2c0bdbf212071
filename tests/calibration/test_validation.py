"""Simulator fidelity: batch shapes counted as the runner does the work, shrunk and session slices,
the record cost of store traffic, and validation's refusal of slices a profile was fitted on.

Fast tests use hand-made chunks and small synthetic traces; the end-to-end validation on the real
engine is marked slow.
"""

import dataclasses
import json
import math
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvstrata.calibration.engine_replay import ShapeRecorder, TransferWaits, fault_in_kv
from kvstrata.calibration.fitted_on import (
    FittedOnError,
    check_not_fitted_on,
    slice_identity,
)
from kvstrata.calibration.slices import Slice, session_lines, spread_ties
from kvstrata.core.hashing import BlockHasher
from kvstrata.core.machine import machine as current_machine
from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from kvstrata.kvcache.prefix_groups import group_cost_tokens, group_decodes
from kvstrata.kvcache.tiers import PROBE_WAIT_S
from kvstrata.model.attention import PagedAttention
from kvstrata.sim.batch_shape import KERNEL_TILE, BatchShape, causal_pairs
from kvstrata.sim.cost_model import CostModel, Link
from kvstrata.sim.simulator import SimConfig, Simulator
from kvstrata.sim.stand_ins import NullMover, SimStore, VirtualClock, VirtualExecutor
from kvstrata.sim.traces import TraceRequest, TraceTokens, shrink
from kvstrata.worker.runner import ModelRunner

BS = 16


def chunk(start: int, n: int, blocks: list[int]) -> SimpleNamespace:
    """A `ScheduledChunk` as the runner and BatchShape read it."""
    return SimpleNamespace(start=start, token_ids=[1] * n, block_ids=blocks, num_tokens=n, sample=True,
                           request=None)


# ---- batch shapes -------------------------------------------------------------------------------
def test_batch_shape_by_hand():
    fresh = chunk(0, 100, list(range(7)))
    later = chunk(40, 20, list(range(10, 14)))                   # keys 0..59: 4 blocks, padded to 64
    shape = BatchShape.of([fresh, later], BS)
    assert shape == BatchShape(prefill_tokens=120, decode_seqs=0, kv_tokens_read=64, attention_pairs=100 * 100,
                               masked_pairs=20 * 64, prefill_chunks=2, decode_groups=0, decode_pairs=0,
                               decode_segments=0, lone_decode_pairs=0, prefix_pairs=0)
    shared = list(range(100, 140))                                # 40 blocks every decode holds
    grouped = [chunk(40 * BS + 3, 1, shared + [200 + i]) for i in range(3)]
    loose = [chunk(9, 1, [300]), chunk(29, 1, [301, 302])]         # 1 and 2 blocks: padded to 2 each
    shape = BatchShape.of(grouped + loose, BS)
    assert shape.decode_groups == 1 and shape.decode_seqs == 5 and shape.decode_segments == 2
    assert shape.kv_tokens_read == (40 + 3 * 1 + 2 * 2) * BS       # the prefix once, own blocks, padding
    assert shape.prefix_pairs == 3 * 40 * BS                       # but attended by each of the 3
    assert shape.decode_pairs == (3 * 1 + 2 * 2) * BS
    assert shape.lone_decode_pairs == 0                            # 3 grouped, 2 batched
    one = BatchShape.of([chunk(100, 1, list(range(7)))], BS)
    assert (one.kv_tokens_read, one.decode_pairs, one.decode_segments, one.lone_decode_pairs) == (7 * BS, 7 * BS, 1,
                                                                                                   7 * BS)
    left = BatchShape.of(grouped + loose[:1], BS)                  # one decode outside the group: alone
    assert left.decode_segments == 2 and left.lone_decode_pairs == 1 * BS
    assert BatchShape.alone(100, 1, BS) == one and BatchShape.alone(40, 20, BS) == BatchShape.of([later], BS)


def test_causal_pairs_are_whole_key_tiles_up_to_the_diagonal():
    """A chunk of up to 512 tokens is one key tile: every pair is computed, masked or not. Longer,
    its query tiles of 256 (from 768 rows) compute the key tiles of 512 they reach."""
    assert [causal_pairs(n) for n in (1, 16, 100, 512)] == [1, 16 * 16, 100 * 100, 512 * 512]
    assert causal_pairs(1024) == 256 * 512 + 256 * 512 + 256 * 1024 + 256 * 1024
    assert causal_pairs(1000) == 256 * 512 + 256 * 512 + 256 * 1000 + 232 * 1000
    assert causal_pairs(600) == 512 * 512 + 64 * 600 + 24 * 600          # query tiles of 64
    assert BatchShape.alone(0, 1000, BS).attention_pairs == causal_pairs(1000)


def _planned(chunks: list[SimpleNamespace], in_place: bool) -> tuple[int, int, int, int, int, int | None]:
    """Tokens PagedAttention gathers for these chunks, planned exactly as the runner plans a step
    (in place: and the keys the kernel makes ready for prefill chunks); tokens its decode attention
    covers (each row's own segment or, in place, its 16-key tiles); its decode attention calls;
    tokens attended by calls for one decode; tokens of the groups' prefixes, per member; in place,
    the query-key pairs the kernel computes for prefill chunks (16-key tiles up to each position)."""
    decodes = [c for c in chunks if c.num_tokens == 1]
    order, groups = group_decodes([c.block_ids for c in decodes], [c.start + 1 for c in decodes], BS,
                                  group_cost_tokens(in_place))
    ordered = [decodes[i] for i in order] + [c for c in chunks if c.num_tokens != 1]
    batch = ModelRunner.build_batch(SimpleNamespace(block_size=BS, device=torch.device("cpu")), ordered, groups)
    attention = PagedAttention(num_heads=9, num_kv_heads=3, head_dim=64)
    if not in_place:
        attention.kernel = None
    assert attention.reads_in_place(BS, torch.float32, torch.device("cpu")) == in_place
    plan = attention.plan(batch, BS, num_blocks=1024, dtype=torch.float32)
    planes = 2 * 3
    rows = 0 if plan.decode_rows is None else plan.decode_rows.shape[0]
    rows += sum(p.rows.shape[0] for p in plan.prefills if p.rows is not None)
    prefixes = sum((seg.end - seg.start) * seg.blocks * BS for seg in plan.prefixes)
    if not in_place:
        own = sum((seg.end - seg.start) * seg.blocks * BS for seg in plan.own)
        lone = sum(seg.blocks * BS for seg in plan.own if seg.end - seg.start == 1)
        return rows // planes * BS, own, len(plan.own), lone, prefixes, None
    tile, call, prefill = KERNEL_TILE, plan.in_place, plan.rows
    kernel = 0 if call is None else sum(-(-int(n) // tile) * tile - int(f) // tile * tile
                                        for f, n in zip(call.first, call.lens))
    ready = pairs = 0
    if prefill is not None:
        assert not plan.prefills
        for s, keys in enumerate(prefill.lens.tolist()):
            n = int(prefill.starts[s + 1] - prefill.starts[s])
            ready += -(-keys // tile) * tile
            pairs += sum(-(-(keys - n + 1 + i) // tile) * tile for i in range(n))
    lone = kernel if len(decodes) == 1 else 0
    return rows // planes * BS + ready, kernel, int(call is not None), lone, prefixes, pairs


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gathered"])
@pytest.mark.parametrize("case", ["shared", "distinct", "mixed", "small-shared", "one"])
def test_batch_shape_counts_what_paged_attention_gathers_and_attends(case, in_place):
    shared = list(range(500, 540))
    if case == "shared":
        chunks = [chunk(40 * BS + i, 1, shared + [600 + i]) for i in range(6)]
    elif case == "distinct":
        chunks = [chunk(16 * i + 5, 1, list(range(100 * i, 100 * i + i + 1))) for i in range(1, 7)]
    elif case == "small-shared":                                 # shares too little to be worth a group
        chunks = [chunk(2 * BS + 1, 1, shared[:2] + [600 + i]) for i in range(4)]
    elif case == "one":
        chunks = [chunk(70, 1, [700, 701, 702, 703, 704]), chunk(0, 50, [800, 801, 802, 803])]
    else:
        chunks = ([chunk(40 * BS + i, 1, shared + [600 + i]) for i in range(4)]
                  + [chunk(70, 1, [700, 701, 702, 703, 704])]
                  + [chunk(0, 50, [800, 801, 802, 803]), chunk(33, 64, [900 + i for i in range(7)])])
    shape = BatchShape.of(chunks, BS, in_place)
    *counted, pairs = _planned(chunks, in_place)
    assert (shape.kv_tokens_read, shape.decode_pairs, shape.decode_segments, shape.lone_decode_pairs,
            shape.prefix_pairs) == tuple(counted)
    if in_place:                                   # prefill chunks: the kernel's tiles, nothing masked
        assert (shape.attention_pairs, shape.masked_pairs) == (pairs, 0)


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


def test_fitted_on_survives_the_profile_file(tmp_path):
    path = _trace(tmp_path / "t.jsonl")
    profile = _profile([{"kind": "grid", "steps": 3, "probe_s": 0.5}, slice_identity(path, "plain", [1, 2])])
    profile.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json").fitted_on == profile.fitted_on


# ---- store records cost engine time -------------------------------------------------------------
def test_records_encoded_and_decoded_accrue_to_the_step():
    mover = NullMover(Link(0.0, 1e12), block_bytes=100, record_seconds=0.25, decode_seconds=0.5)
    record = mover.encode("device", 0, b"h" * 16, [1])
    mover.decode_into("device", 1, record, b"h" * 16, [1])
    assert mover.take_seconds() == 0.75 and mover.take_seconds() == 0.0
    same = NullMover(Link(0.0, 1e12), block_bytes=100, record_seconds=0.25)
    same.decode_into("device", 1, record, b"h" * 16, [1])
    assert same.take_seconds() == 0.25


def test_a_profile_decodes_records_at_its_decode_link_or_else_its_record_link(tmp_path):
    base = CostModel(source="t", kv_bytes_per_token=10, host_link=Link(0.0, 1e9), store_link=Link(0.0, 1e9),
                     compute=(0.0,) * 12, record_link=Link(1e-3, 160e3))
    assert base.record_seconds(16) == base.record_seconds(16, decode=True) == pytest.approx(2e-3)
    split = CostModel(**{**base.__dict__, "decode_link": Link(0.0, 40e3)})
    split.save(tmp_path / "p.json")
    loaded = CostModel.load(tmp_path / "p.json")
    assert loaded == split and loaded.record_seconds(16) == pytest.approx(2e-3)
    assert loaded.record_seconds(16, decode=True) == pytest.approx(4e-3)


def test_a_store_hit_pays_for_decoding_its_records():
    """As tests/test_simulator's store-hit case: C evicts A's 4 blocks to the store, B loads them back.
    Each record costs 1 ms of B's first step per block B loads (or any block its admission evicts)."""
    trace = [TraceRequest(0.0, 1024, 1, (1, 2)), TraceRequest(10.0, 1536, 1, (7, 8, 9)),
             TraceRequest(20.0, 1536, 1, (1, 2, 3))]
    config = SimConfig(block_size=256, device_cache_tokens=1536, store_cache_tokens=None)

    def run(record_link):
        cost = CostModel(source="t", kv_bytes_per_token=1, host_link=Link(0.0, 1e12), store_link=Link(0.5, 1e12),
                         compute=(0.01, 0.001, 0.002, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), record_link=record_link)
        return Simulator(trace, config, cost).run()

    free, paid = run(None), run(Link(1e-3, 1e30))
    extra = paid.records[2].ttft - free.records[2].ttft
    assert paid.to_json()["transfers"]["loaded_blocks"]["store"] == 4
    assert extra >= 4e-3 - 1e-12 and extra == pytest.approx(round(extra / 1e-3) * 1e-3, abs=1e-12)


def test_a_link_is_read_from_the_time_of_one_block_and_of_many():
    from kvstrata.calibration.calibrate import _link

    truth, size = Link(1e-4, 2e9), 368_640
    link = _link(truth.seconds(size), truth.seconds(32 * size), size)
    assert (link.latency_s, link.bandwidth) == pytest.approx((truth.latency_s, truth.bandwidth))


# ---- store lookups the engine waits for ---------------------------------------------------------
def test_a_lookup_within_the_engines_wait_is_answered_in_the_step_and_charged_to_it():
    """The engine's plan() waits up to PROBE_WAIT_S for a store lookup, so a fast store answers in
    the same step; a slower one defers the request. Loads and deletes are never waited for."""
    clock, posted = VirtualClock(), []
    clock.now = 7.0
    store = SimStore()
    store.put([(b"a", b"a")])

    def run(latency: float) -> tuple[Future, float]:
        executor = VirtualExecutor(clock, Link(latency, 1e9), 100, lambda at, done: posted.append((at, done)),
                                   PROBE_WAIT_S)
        return executor.submit(store.exists, [b"a", b"b"]), executor.take_waited()

    fast, waited = run(1e-3)
    assert fast.done() and fast.result() == [True, False] and waited == pytest.approx(1e-3) and not posted
    slow, waited = run(PROBE_WAIT_S * 2)
    assert not slow.done() and waited == 0.0 and posted[0][0] == pytest.approx(7.0 + PROBE_WAIT_S * 2)
    executor = VirtualExecutor(clock, Link(1e-4, 1e9), 100, lambda at, done: posted.append((at, done)), PROBE_WAIT_S)
    assert not executor.submit(store.get, [b"a"]).done() and not executor.submit(store.delete, [b"a"]).done()
    assert executor.take_waited() == 0.0


def test_a_store_call_is_sent_after_the_engine_threads_work_so_far_in_the_step():
    """schedule() copies host hits and encodes evicted records between one admission's store load and
    the next: a call goes out when the engine thread gets to it, and a lookup's wait counts from then."""
    clock, posted, busy = VirtualClock(), [], [0.0]
    clock.now = 3.0
    store = SimStore()
    executor = VirtualExecutor(clock, Link(1e-3, 1e9), 100, lambda at, done: posted.append((at, done)),
                               PROBE_WAIT_S, busy=lambda: busy[0])
    executor.submit(store.get, [b"a"])
    busy[0] = 0.25
    executor.submit(store.get, [b"b"])
    assert [at for at, _ in posted] == pytest.approx([3.0 + 1e-3 + 1e-7, 3.25 + 1e-3 + 1e-7])
    assert executor.submit(store.exists, [b"a"]).done() and executor.take_waited() == pytest.approx(1e-3 + 1e-7)


def test_a_step_that_only_starts_a_load_keeps_the_engine_busy_while_it_encodes():
    """C's admission loads A's evicted blocks and evicts B's, whose records the engine thread encodes
    (0.1 s each) before it steps again: D, arriving meanwhile, joins C's first step as in the engine,
    rather than running alone in an engine the simulator thought idle."""
    trace = [TraceRequest(0.0, 1024, 1, (1, 2)), TraceRequest(10.0, 1536, 1, (7, 8, 9)),
             TraceRequest(20.0, 1536, 1, (1, 2, 3)), TraceRequest(20.06, 256, 1, (11,))]
    config = SimConfig(block_size=256, device_cache_tokens=2048, store_cache_tokens=None)
    cost = CostModel(source="t", kv_bytes_per_token=1, host_link=Link(0.0, 1e12), store_link=Link(0.05, 1e12),
                     compute=(0.01, 0.001, 0.002, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), record_link=Link(0.1, 1e30))
    result = Simulator(trace, config, cost).run()
    a, b, c, d = result.records
    assert c.cached_tokens == 1024 and result.to_json()["transfers"]["loaded_blocks"]["store"] > 0
    assert d.first_token == c.first_token and d.ttft > 0.3


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


# ---- engines are timed warm ---------------------------------------------------------------------
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
