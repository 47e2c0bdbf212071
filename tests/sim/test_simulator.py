"""The simulator: trace replay, hand-computed timings, hit rates against the ideal, audit, CLI.

Most tests use a small synthetic Mooncake trace (chat sessions whose turns extend the previous
turn's blocks, all behind one system prompt), so they run anywhere; the 500-request audit uses
the real conversation trace when `../shared/data/traces/` is present.
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstrata.core.hashing import BlockHasher
from kvstrata.entrypoints.cli.simulate import parse_sweep
from kvstrata.sim.batch_shape import BatchShape
from kvstrata.sim.config import SimConfig
from kvstrata.sim.cost_model import CostModel, Link, fit
from kvstrata.sim.roofline import roofline
from kvstrata.sim.simulator import Simulator
from kvstrata.sim.traces import TraceRequest, TraceTokens, ideal_hit_rate, read_mooncake

REAL_TRACE = Path(__file__).resolve().parents[3] / "shared/data/traces/conversation_trace.jsonl"


def fixed_cost(step=0.01, per_prefill_token=0.001, per_decode=0.002, store=Link(0.5, 1e12)) -> CostModel:
    """step = 10 ms + 1 ms per prefill token + 2 ms per decode; host copies free; store loads 0.5 s."""
    return CostModel(source="test: fixed", kv_bytes_per_token=1, host_link=Link(0.0, 1e12), store_link=store,
                     compute=(step, per_prefill_token, per_decode, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))


def synthetic_trace(path: Path, sessions: int = 40, turns: int = 5, gap_ms: int = 700, seed: int = 0,
                    max_live: int = 8) -> Path:
    """Chat sessions: each turn's prompt is the last prompt plus new blocks; one shared system prompt.
    At most `max_live` sessions are open at once: more of them push each other out of small tiers."""
    rng = np.random.default_rng(seed)
    next_id, lines, clock = 1, [], 0
    live = []
    for _ in range(sessions * turns):
        if live and (len(live) >= max_live or rng.random() < 0.7):
            index = int(rng.integers(len(live)))
            ids, turn = live[index]
        else:
            ids, turn, index = [0], 0, None
        grow = int(rng.integers(1, 4))
        ids = ids + list(range(next_id, next_id + grow))
        next_id += grow
        length = (len(ids) - 1) * 512 + int(rng.integers(1, 513))
        lines.append({"timestamp": clock, "input_length": length, "output_length": int(rng.integers(1, 40)),
                      "hash_ids": ids})
        clock += int(rng.integers(0, gap_ms))
        if index is not None:
            live.pop(index)
        if turn + 1 < turns:
            live.append((ids, turn + 1))
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture
def trace_file(tmp_path) -> Path:
    return synthetic_trace(tmp_path / "trace.jsonl")


def spaced(trace: list[TraceRequest], gap: float) -> list[TraceRequest]:
    """The same requests one at a time: each arrives `gap` seconds after the one before."""
    return [TraceRequest(i * gap, r.input_length, r.output_length, r.hash_ids) for i, r in enumerate(trace)]


# ---- traces -------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [16, 128, 512])
def test_trace_hashes_are_the_block_hashers_at_any_block_size(trace_file, block_size):
    tokens = TraceTokens(BlockHasher.create(block_size, "m"))
    for request in read_mooncake(trace_file, max_requests=12):
        prompt = tokens.prompt(request)
        expected = []
        tokens.hasher.extend(expected, prompt)
        assert len(prompt) == request.input_length and max(prompt) < 256
        assert tokens.block_hashes(request) == expected


def test_equal_trace_ids_give_equal_tokens_and_different_ids_do_not():
    tokens = TraceTokens(BlockHasher.create(64, "m"))
    a = tokens.prompt(TraceRequest(0, 1024, 1, (5, 6)))
    b = tokens.prompt(TraceRequest(0, 700, 1, (5, 7)))
    assert a[:512] == b[:512] and a[512:700] != b[512:700]


def test_read_mooncake_slices_scales_and_caps(trace_file):
    full = read_mooncake(trace_file)
    part = read_mooncake(trace_file, max_requests=5, skip=3, time_scale=2.0, max_input_tokens=600,
                         max_output_tokens=4)
    assert len(part) == 5 and part[0].arrival == 0.0
    assert part[1].arrival == pytest.approx((full[4].arrival - full[3].arrival) * 2)
    for cut, original in zip(part, full[3:8]):
        assert cut.input_length == min(600, original.input_length) and cut.output_length <= 4
        assert cut.hash_ids == original.hash_ids[:math.ceil(cut.input_length / 512)]


def test_read_mooncake_refuses_a_line_whose_ids_do_not_cover_its_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1500, "output_length": 3, "hash_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="hash_ids"):
        read_mooncake(bad)


# ---- cost model ---------------------------------------------------------------------------------
def test_fit_recovers_known_coefficients_and_profiles_round_trip(tmp_path):
    truth = CostModel(source="truth", kv_bytes_per_token=1, host_link=Link(0.0, 1e12), store_link=Link(0.5, 1e12),
                      compute=(0.01, 0.001, 0.002, 1e-6, 3e-8, 5e-8, 0.004, 0.003, 2e-7, 0.005, 1e-7, 6e-8))
    shapes = [BatchShape(p, d, c * p + d * context, (1 - c) * p * p // 2, c * p * (p + context), k, d // 8,
                         d * context * (1 + d // 8), min(d, 1 + d // 8), context if d == 1 else 0,
                         (d // 8) * context * (k + c))
              for p in (0, 16, 256, 1024) for d in (0, 1, 8, 32) for context in (100, 1000) for c in (0, 1)
              for k in (1, 3) if p or d]
    fitted = fit(shapes, [truth.step_seconds(s) for s in shapes], source="test", kv_bytes_per_token=1,
                 host_link=truth.host_link, store_link=truth.store_link, fitted_on=({"kind": "grid", "steps": 1},))
    assert fitted.compute == pytest.approx(truth.compute, rel=1e-6)
    fitted.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json") == fitted


def test_roofline_decode_is_bound_by_weights_and_kv_and_prefill_by_flops():
    h100 = roofline("h100", "llama3-8b")
    weights = 8.03e9 * 2 / (3.35e12 * 0.8)
    assert h100.step_seconds(BatchShape(0, 1, 1000, 0)) == pytest.approx(0.002 + weights + 1000 * 131072 / 2.68e12)
    assert h100.step_seconds(BatchShape(8192, 0, 8192, 8192 * 8193 // 2)) > 2 * 8.03e9 * 8192 / 989e12
    assert "roofline: h100" in h100.source and h100.device_cache_tokens > 300_000


def test_the_shipped_shapes_are_priced_on_the_roofline():
    """`--model llama-3.2-1b` is the shape `--load-format dummy` serves: 1.24B parameters, 32 KiB of KV a token."""
    small, large = roofline("h100", "llama-3.2-1b"), roofline("h100", "llama-3.1-8b")
    assert small.kv_bytes_per_token == 2 * 16 * 8 * 64 * 2 and large.kv_bytes_per_token == 131072
    decode = BatchShape(0, 1, 1000, 0)
    assert small.step_seconds(decode) < large.step_seconds(decode)
    assert "llama-3.2-1b (GQA 32/8 heads, 16 layers)" in small.source


# ---- the simulator ------------------------------------------------------------------------------
def test_requests_under_an_adapter_hit_only_that_adapters_blocks(tmp_path):
    """The simulator keys blocks as the engine does: the same trace blocks under another adapter (or the
    base) are a miss, under the same adapter a hit; a trace's `adapter` field says which."""
    trace = [TraceRequest(0.0, 1024, 2, (1, 2)), TraceRequest(10.0, 1024, 2, (1, 2), "sql"),
             TraceRequest(20.0, 1024, 2, (1, 2), "chat"), TraceRequest(30.0, 1024, 2, (1, 2), "sql")]
    tokens = TraceTokens(BlockHasher.create(256, "m"))
    hashes = [set(tokens.block_hashes(r)) for r in trace]
    assert not hashes[0] & hashes[1] and not hashes[1] & hashes[2] and hashes[1] == hashes[3]
    result = Simulator(trace, SimConfig(block_size=256, audit=True), fixed_cost()).run()
    assert [r.cached_tokens for r in result.records] == [0, 0, 0, 768]    # the last block is recomputed
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2], '
                    '"adapter": "sql"}\n')
    assert read_mooncake(path)[0].adapter == "sql"


def test_two_requests_by_hand():
    """A: 1024 prompt tokens at t=0, 3 outputs. B: A's 4 blocks + 2 more at t=10, 2 outputs (block 256).

    A prefills 1024 tokens in one step: 0.01 + 1.024 = 1.034 s, then decodes twice (0.012 s each).
    B hits A's 4 full blocks (1024 tokens) and computes 512: 0.01 + 0.512 = 0.522 s.
    Hit rate: 4 of 4 + 6 prompt blocks.
    """
    trace = [TraceRequest(0.0, 1024, 3, (1, 2)), TraceRequest(10.0, 1536, 2, (1, 2, 3))]
    result = Simulator(trace, SimConfig(block_size=256), fixed_cost()).run()
    a, b = result.records
    assert a.ttft == pytest.approx(1.034, abs=1e-12) and a.finish == pytest.approx(1.058, abs=1e-12)
    assert a.tpot == pytest.approx(0.012, abs=1e-12)
    assert b.ttft == pytest.approx(0.522, abs=1e-12) and b.cached_tokens == 1024
    report = result.to_json()
    assert report["hit_rate"] == {"device": 0.4, "host": 0.0, "store": 0.0, "total": 0.4}
    assert report["ideal_hit_rate"] == 0.4


def test_a_step_time_target_cuts_a_long_prefill_beside_decodes_as_the_engine_does():
    """Ten 64-token prompts 0.2 s apart (a prefill step each: the fit needs 8) decode 200 tokens each; a
    4096-token prompt arrives at 3 s. Without a target its prefill is one 4.1 s step that every stream
    waits for; with --max-tpot-ms 100 the engine's step cost, learned from the simulated steps, cuts it
    to what fits beside ten decodes (5 x 30 ms), and every request still gets all its tokens."""
    trace = [TraceRequest(0.2 * i, 64, 200, (i,)) for i in range(10)] + [TraceRequest(3.0, 4096, 2, tuple(range(10, 18)))]
    runs = {target: Simulator(trace, SimConfig(block_size=64, max_tpot_ms=target, audit=True), fixed_cost()).run()
            for target in (0.0, 100.0)}
    assert max(runs[0.0].itl) > 4.0
    assert max(runs[100.0].itl) < 0.2
    for result in runs.values():
        assert result.to_json()["output_tokens"] == 10 * 200 + 2
        assert len(result.itl) == 10 * 199 + 1
    assert runs[100.0].records[-1].ttft > runs[0.0].records[-1].ttft     # the long prompt pays for it


def test_engines_sharing_cores_slow_each_others_steps_while_both_compute():
    """Round robin over 2 engines: A (1000 tokens, a 1.01 s step) at t=0 on engine 0, B (500 tokens, 0.51 s)
    at t=0.51 on engine 1, one output each. On 2 cores, or a core each, neither slows. On 1 core, with no
    serving overhead, A runs alone at full speed until B arrives (0.5 s of work left), then both at half:
    A ends at 0.51 + 1.0 = 1.51 s, when B has 0.01 s of work left, done alone by 1.52 s. With a serving
    overhead of 1 every engine needs two cores' worth: A alone gets half a core, both a quarter each."""
    trace = [TraceRequest(0.0, 1000, 1, (1, 2)), TraceRequest(0.51, 500, 1, (3,))]

    def ttfts(**cores) -> list[float]:
        result = Simulator(trace, SimConfig(block_size=256, instances=2, audit=True, **cores), fixed_cost()).run()
        audit = result.to_json()["audit"]
        assert audit["steps_audited"] == 2 and audit["device_used_at_end"] == audit["device_in_flight_at_end"] == 0
        return [r.ttft for r in result.records]

    assert ttfts() == ttfts(host_cores=2) == pytest.approx([1.01, 0.51], abs=1e-12)
    assert ttfts(host_cores=1) == pytest.approx([1.51, 1.01], abs=1e-12)
    b_end = 0.51 + 0.51 * 4                             # A did 0.255 s of work alone; B's 0.51 s at a quarter
    a_end = b_end + (1.01 - 0.255 - 0.51) * 2           # A did 0.51 s more beside B; the rest at half a core
    assert ttfts(host_cores=1, serving_overhead=1.0) == pytest.approx([a_end, b_end - 0.51], abs=1e-12)
    for wrong in ({"host_cores": 0}, {"serving_overhead": -0.1}):
        with pytest.raises(ValueError, match="host_cores must be positive|serving_overhead must not be negative"):
            SimConfig(**wrong).validate()


def test_a_store_hit_waits_in_loading_for_its_transfer():
    """The device holds 6 blocks: C evicts A's 4 to the store, where B finds them 0.5 s per store call later."""
    trace = [TraceRequest(0.0, 1024, 1, (1, 2)), TraceRequest(10.0, 1536, 1, (7, 8, 9)),
             TraceRequest(20.0, 1536, 1, (1, 2, 3))]
    config = SimConfig(block_size=256, device_cache_tokens=1536, store_cache_tokens=None)
    result = Simulator(trace, config, fixed_cost()).run()
    report = result.to_json()
    assert report["transfers"]["loaded_blocks"]["store"] == 4 and report["hit_rate"]["store"] == 4 / 16
    # a lookup (0.5 s), then the load (0.5 s + 4 blocks of 256 one-byte tokens at 1e12 B/s), then 512 tokens
    assert result.records[2].ttft == pytest.approx(0.5 + (0.5 + 1024 / 1e12) + 0.522, abs=1e-12)


def ideal_from_ids(trace: list[TraceRequest]) -> float:
    """The infinite-cache hit rate at block 512 from trace ids alone: a request hits the leading blocks
    an earlier prompt held in full, except the one holding its last token."""
    full, hits, total = set(), 0, 0
    for r in trace:
        limit, matched = (r.input_length - 1) // 512, 0
        while matched < limit and r.hash_ids[matched] in full:
            matched += 1
        hits, total = hits + matched, total + len(r.hash_ids)
        full.update(r.hash_ids[:r.input_length // 512])
    return hits / total


def test_ideal_hit_rate_follows_the_trace_ids(trace_file):
    trace = read_mooncake(trace_file)
    assert ideal_hit_rate(trace, TraceTokens(BlockHasher.create(512, "m"))) == ideal_from_ids(trace)


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="the shared conversation trace is not here")
def test_the_conversation_traces_ideal_is_0_366():
    trace = read_mooncake(REAL_TRACE)
    assert len(trace) == 12031
    assert ideal_hit_rate(trace, TraceTokens(BlockHasher.create(512, "m"))) == pytest.approx(0.366, abs=5e-4)


def test_unbounded_cache_without_concurrency_reaches_the_ideal_exactly(trace_file):
    trace = spaced(read_mooncake(trace_file, max_requests=120), gap=100.0)
    for block_size in (64, 512):
        report = Simulator(trace, SimConfig(block_size=block_size), fixed_cost(per_prefill_token=1e-4)).run().to_json()
        assert report["hit_rate"]["total"] == report["ideal_hit_rate"] > 0.3
        assert report["preemptions"] == 0


@pytest.mark.parametrize("config", [
    SimConfig(block_size=64, device_cache_tokens=8192),
    SimConfig(block_size=64, device_cache_tokens=4096, host_cache_tokens=8192, store_cache_tokens=16384),
    SimConfig(block_size=512, device_cache_tokens=None, instances=3, router="kv_aware"),
    SimConfig(block_size=128, device_cache_tokens=8192, store_cache_tokens=None, instances=4,
              router="prefix_affinity", write_policy="write_through"),
])
def test_hit_rate_never_exceeds_the_ideal(trace_file, config):
    trace = read_mooncake(trace_file, max_input_tokens=3000, max_output_tokens=8)
    report = Simulator(trace, config, fixed_cost(per_prefill_token=2e-5, per_decode=1e-3)).run().to_json()
    assert 0 < report["hit_rate"]["total"] <= report["ideal_hit_rate"]
    assert report["requests"] == len(trace)


def test_cache_aware_routers_beat_round_robin(trace_file):
    trace = read_mooncake(trace_file, max_output_tokens=8)
    rates = {}
    for router in ("round_robin", "prefix_affinity", "kv_aware"):
        config = SimConfig(block_size=512, instances=4, router=router)
        report = Simulator(trace, config, fixed_cost(per_prefill_token=2e-5)).run().to_json()
        rates[router] = report["hit_rate"]["total"]
    assert rates["prefix_affinity"] > rates["round_robin"] and rates["kv_aware"] > rates["round_robin"]


def test_same_inputs_give_the_same_json(trace_file):
    trace = read_mooncake(trace_file, max_input_tokens=3000)
    config = SimConfig(block_size=64, device_cache_tokens=6144, host_cache_tokens=6144, store_cache_tokens=20000,
                       instances=2, router="kv_aware")
    runs = [Simulator(trace, config, roofline("a100", "llama3-8b")).run().to_json() for _ in range(2)]
    for run in runs:
        run.pop("wall_s")
    assert runs[0] == runs[1]


def test_requests_that_can_never_fit_are_refused_up_front():
    with pytest.raises(ValueError, match="device-cache-tokens"):
        Simulator([TraceRequest(0.0, 4096, 1, tuple(range(8)))], SimConfig(block_size=64, device_cache_tokens=1024),
                  fixed_cost())


def test_audit_on_500_requests_with_small_tiers(trace_file, tmp_path):
    """Every step audited; at the end no block is USED or IN_FLIGHT on any tier."""
    path = REAL_TRACE if REAL_TRACE.exists() else synthetic_trace(tmp_path / "long.jsonl", sessions=100, max_live=32)
    out = tmp_path / "audit.json"
    _cli("simulate", "--trace", str(path), "--max-requests", "500", "--block-size", "16",
         "--max-input-tokens", "640", "--max-output-tokens", "32", "--device-cache-tokens", "2048",
         "--host-cache-tokens", "2048", "--store-cache-tokens", "65536", "--store-timeout", "0.05",
         "--hardware", "a100", "--time-scale", "0.1", "--audit", "--output-json", str(out))
    report = json.loads(out.read_text())
    assert report["requests"] == 500 and report["audit"]["steps_audited"] == report["steps"] > 0
    assert {key: value for key, value in report["audit"].items() if key != "steps_audited"} == {
        "device_used_at_end": 0, "device_in_flight_at_end": 0, "host_used_at_end": 0, "host_in_flight_at_end": 0}
    assert report["evictions"]["device"] > 0 and report["evictions"]["host"] > 0
    assert report["transfers"]["loaded_blocks"]["store"] > 0


# ---- command line -------------------------------------------------------------------------------
def _cli(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "kvstrata", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_sweep_writes_hit_rates_beside_the_ideal_and_plots(trace_file, tmp_path):
    out = tmp_path / "sweep.json"
    stdout = _cli("simulate", "--trace", str(trace_file), "--block-size", "64", "--device-cache-tokens", "4096",
                  "--sweep", "host_cache_tokens=0,8k,inf", "--max-input-tokens", "3000", "--max-output-tokens", "8",
                  "--hardware", "a100",
                  "--output-json", str(out), "--plot", str(tmp_path / "plots"))
    report = json.loads(out.read_text())
    rates = [run["hit_rate"]["total"] for run in report["runs"]]
    assert report["sweep"] == {"parameter": "host_cache_tokens", "values": [0, 8000, None]}
    assert rates[0] <= rates[1] <= rates[2] <= report["ideal_hit_rate"]
    assert (tmp_path / "plots/hit_rate_vs_host_cache_tokens.png").stat().st_size > 0
    assert (tmp_path / "plots/ttft_cdf.png").stat().st_size > 0 and "ideal" in stdout


def test_sweep_names_a_capacity():
    assert parse_sweep("--store-cache-tokens=1M,inf") == ("store_cache_tokens", [1_000_000, None])
    with pytest.raises(ValueError, match="PARAM"):
        parse_sweep("instances=1,2")


def test_the_simulator_never_imports_torch(trace_file):
    code = ("import sys; from kvstrata.entrypoints.cli.simulate import simulate; from kvstrata.sim.simulator import Simulator; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_simulate_warns_when_arrivals_outrun_the_fleet(trace_file):
    """The same trace squeezed into a few seconds overloads one engine: the CLI says so, by how much,
    and how many engines to try; spread out, it does not."""
    flags = ("simulate", "--trace", str(trace_file), "--block-size", "64", "--max-input-tokens", "3000",
             "--max-output-tokens", "8", "--hardware", "cpu-2core", "--model", "smollm2-135m")
    squeezed = _cli(*flags, "--time-scale", "0.01")
    assert "warning: arrivals exceed what 1 engine can serve" in squeezed
    suggested = int(re.search(r"try --instances (\d+)", squeezed).group(1))
    assert suggested >= 2
    relaxed = _cli(*flags, "--time-scale", "50")
    assert "warning" not in relaxed
