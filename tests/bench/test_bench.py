"""The benchmark code itself: workloads, metrics, the streaming client against a live server, reports."""

import json
import math

import httpx
import numpy as np
import pytest

from kvstrata.bench.cases import read_cases, write_cases
from kvstrata.bench.loadgen import UNMAPPED, arrival_times, gauge_value
from kvstrata.bench.metrics import RequestResult, RunMetrics, Summary, parse_slo, percentile
from kvstrata.bench.workloads import TOKEN_HIGH, TOKEN_LOW, WorkloadOptions, build_workload
from kvstrata.entrypoints.cli.main import main
from tests.entrypoints.server_helpers import running_server


# ---- metrics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("values", [[5.0], [1.0, 2.0], [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0], list(range(101))])
def test_percentiles_match_numpy(values):
    ordered = sorted(values)
    for q in (0, 50, 90, 99, 100):
        assert percentile(ordered, q) == pytest.approx(float(np.percentile(values, q)))


def test_summary_in_milliseconds():
    s = Summary.of([0.001 * v for v in range(1, 101)])
    assert (s.mean, s.p50, s.count) == (pytest.approx(50.5), pytest.approx(50.5), 100)
    assert s.p99 == pytest.approx(99.01)
    assert math.isnan(Summary.of([]).p50)


def test_goodput_counts_requests_within_every_slo():
    def result(ttft, e2el, tokens=11, ok=True):
        return RequestResult(ok=ok, prompt_tokens=100, output_tokens=tokens, cached_tokens=50, ttft=ttft, e2el=e2el)
    results = [result(0.1, 1.1),            # tpot 0.1: good
               result(0.3, 1.3),            # ttft too slow
               result(0.1, 3.1),            # tpot 0.3: too slow
               result(0.1, 1.1, ok=False)]  # failed: never good
    metrics = RunMetrics.of(results, duration=2.0, slo=parse_slo("ttft=200,tpot=150"))
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert metrics.goodput == pytest.approx(0.5)
    assert metrics.request_throughput == pytest.approx(1.5)
    assert metrics.output_throughput == pytest.approx(33 / 2)
    assert metrics.cached_fraction == pytest.approx(0.5)
    assert metrics.tpot_ms.p50 == pytest.approx(100.0)
    assert RunMetrics.of(results, 2.0, {}).goodput == pytest.approx(1.5)      # no SLO: every completed request


def test_slo_parsing_refuses_unknown_names():
    assert parse_slo("ttft=500, e2el=2000") == {"ttft": 0.5, "e2el": 2.0}
    with pytest.raises(ValueError):
        parse_slo("latency=5")


# ---- workloads ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random", "shared-prefix", "multi-turn"])
def test_workloads_are_deterministic_for_a_seed(kind):
    opts = WorkloadOptions(num_requests=12, input_len=20, output_len=5, range_ratio=0.5, num_prefixes=3,
                           prefix_len=32, turns=3)
    first, again, other = (build_workload(kind, opts, seed) for seed in (7, 7, 8))
    assert first == again and first != other
    assert first.num_requests == 12
    assert all(TOKEN_LOW <= t < TOKEN_HIGH for s in first.sessions for turn in s.turns for t in turn.prompt)


def test_shared_prefix_and_multi_turn_shapes():
    opts = WorkloadOptions(num_requests=8, input_len=10, output_len=4, num_prefixes=2, prefix_len=16, turns=4)
    prompts = [s.turns[0].prompt for s in build_workload("shared-prefix", opts, 0).sessions]
    assert len({p[:16] for p in prompts}) == 2 and len({p[16:] for p in prompts}) == 8
    assert sorted(sum(p[:16] == q[:16] for q in prompts) for p in prompts) == [4] * 8
    conversation = build_workload("multi-turn", opts, 0).sessions[0].turns
    assert [len(t.prompt) for t in conversation] == [10, 24, 38, 52]       # + user 10, + reply 4 per turn
    assert all(b.prompt[:len(a.prompt)] == a.prompt for a, b in zip(conversation, conversation[1:]))


def test_trace_synthesis_gives_equal_tokens_for_equal_hash_ids(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 9, "hash_ids": [1, 2]},
            {"timestamp": 500, "input_length": 1500, "output_length": 900, "hash_ids": [1, 2, 3]},
            {"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [1, 4]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    opts = WorkloadOptions(num_requests=3, output_len=64, trace_length_scale=0.125, trace_time_scale=2.0)
    a, b, c = (s.turns[0] for s in build_workload(f"trace:{trace}", opts, 0).sessions)
    assert [len(t.prompt) for t in (a, b, c)] == [128, 188, 75]            # 64 tokens per hash id
    assert b.prompt[:128] == a.prompt                                      # ids 1, 2 shared
    assert c.prompt[:64] == a.prompt[:64] and c.prompt[64:75] != a.prompt[64:75]  # id 1 shared, then 4 != 2
    assert (a.max_tokens, b.max_tokens) == (9, 64)
    sessions = build_workload(f"trace:{trace}", opts, 0).sessions
    assert [s.arrival for s in sessions] == [0.0, 1.0, 2.0]
    assert build_workload(f"trace:{trace}", opts, 0) == build_workload(f"trace:{trace}", opts, 1)


def test_arrivals_poisson_mean_and_infinite_rate():
    times = arrival_times(2001, rate=4.0, burstiness=1.0, seed=0)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / 2000 == pytest.approx(0.25, rel=0.1)
    assert arrival_times(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


# ---- against a live server ----------------------------------------------------------------------
def test_bench_serve_against_a_live_server(smollm2, tmp_path, capsys):
    out = tmp_path / "run"
    with running_server(smollm2, num_device_blocks=256) as (base, _):
        code = main(["bench", "serve", "--base-url", base, "--compare-url", base, "--label", "first",
                     "--label", "second", "--workload", "shared-prefix", "--num-requests", "4",
                     "--num-prefixes", "1", "--prefix-len", "48", "--input-len", "8", "--output-len", "6",
                     "--request-rate", "inf", "--slo", "ttft=60000", "--warmup-requests", "1",
                     "--no-progress", "--output", str(out)])
        # the bench waited (warm_up) until the server had mapped its KV memory, as its gauge says
        assert gauge_value(httpx.get(base + "/metrics").text, UNMAPPED) == 0
    assert code == 0
    text = capsys.readouterr().out
    assert "first/second" in text and "TTFT p99 (ms)" in text
    data = json.loads(out.with_suffix(".json").read_text())
    for label in ("first", "second"):
        m = data["summary"][label]
        assert (m["completed"], m["failed"], m["mean_output_tokens"]) == (4, 0, 6)
        assert m["ttft_ms"]["p50"] > 0 and m["tpot_ms"]["count"] == 4 and m["itl_ms"]["count"] == 4 * 5
        assert m["goodput"] == pytest.approx(m["request_throughput"])
    # the second server (the same one) finds every full block of the first's prompts cached
    assert data["summary"]["first"]["cached_fraction"] < data["summary"]["second"]["cached_fraction"]
    assert data["ratios"]["first/second"]["completed"] == 1.0
    assert all(0.0 <= run["cpu_busy_before"] <= 1.0 for run in data["runs"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the server's timelines of every request came back, and account for the client's e2e but what is outside it
    assert "first: where the time went (s), the slowest 1 of 4 by e2e latency" in text
    for label in ("first", "second"):
        tails = data["tails"][label]
        assert tails["timelines"] == 4 and tails["slowest"][0]["request_id"].startswith("cmpl-")
        for slow in tails["slowest"]:
            parts = slow["breakdown"]
            assert sum(parts.values()) == pytest.approx(slow["e2el"]) and parts["prefill"] > 0 < parts["decode"]
            assert -0.005 < parts["outside"] < slow["e2el"] and slow["timeline"]["received"] is not None


@pytest.mark.slow     # 24 s: two engines' full offline cases
def test_bench_offline(tmp_path, capsys):
    from kvstrata.bench.offline import make_cases

    prompts, figures = tmp_path / "prompts.json", tmp_path / "offline.json"
    write_cases(prompts, make_cases([1, 3], input_len=20, output_len=5, repeats=2, seed=0))
    assert [len(c.repeats[1]) for c in read_cases(prompts)] == [1, 3]
    assert main(["bench", "offline", "--prompts", str(prompts), "--json", str(figures), "--quantization", "int8",
                 "--versus-float32", "--kv-cache-memory", "64MiB", "--audit-every-step"]) == 0
    data = json.loads(figures.read_text())
    for engine in (data, data["float32"]):                  # int8, then the same cases in float32
        assert [c["num_prompts"] for c in engine["cases"]] == [1, 3]
        for case in engine["cases"]:
            assert len(case["elapsed_s"]) == len(case["cpu_busy"]) == 2
            assert case["output_tok_s"] >= case["median_output_tok_s"] > 0        # the fastest repeat heads
            assert case["steps"] >= 5 and 0 < case["weight_gb_s"] < engine["memory_read_gb_s"] * 2
    assert data["quantization"] == "int8" and data["float32"]["quantization"] == "none"
    assert data["float32"]["weight_bytes"] == 134_515_008 * 4 > 3.5 * data["weight_bytes"]
    assert data["machine"]["cores"] >= 1 and "avx2" in data["machine"]["isa"]
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "weights GB/s" in out and "int8 kernel" in out
    assert "float32 int8 / float32 output tok/s, same cases, same run: batch 1 " in out
