"""BENCHMARKS.md's host probe and shared-prefix decode sections, rendered from results files as
`benchmarks/run_all.py` writes them (the scripts in benchmarks/ are not a package: loaded by path)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))
import render_md  # noqa: E402


def timings(b1: float, b32: float) -> dict:
    return {"ctx": 600, "threads": 2, "repeat": 20,
            "timings": [{"run": "decode batch 1", "model": "bfloat16", "fastest_ms": b1, "median_ms": b1 + 1},
                        {"run": "decode batch 32", "model": "bfloat16", "fastest_ms": b32, "median_ms": b32 + 1}]}


def test_probe_line_shows_start_and_end():
    line = render_md.probe_line({"start": timings(12.6, 56.3), "end": timings(19.0, 64.8)})
    assert len(line) == 1
    assert "decode batch 1, decode batch 32 at 600 tokens" in line[0]
    assert "start 12.6 / 56.3; end 19.0 / 64.8" in line[0]
    assert render_md.probe_line({}) == []


def test_prefix_decode_section_per_dtype(tmp_path):
    def pair(shared: float, distinct: float) -> dict:
        return {case: {"seconds": s, "cpu_seconds": 2 * s, "cached": 0.985, "busy": 0.02, "digest": "x"}
                for case, s in (("shared", shared), ("distinct", distinct))}
    pairs = [pair(3.0, 4.0), pair(3.2, 4.0)]
    ratios = [p["shared"]["seconds"] / p["distinct"]["seconds"] for p in pairs]
    (tmp_path / "prefix-decode-float32.json").write_text(json.dumps(
        {"seqs": 16, "prefix": 1024, "own": 16, "tokens": 64, "threads": 2, "dtype": "float32", "pairs": pairs,
         "ratios": ratios, "cpu_ratios": ratios, "median_ratio": sum(ratios) / 2, "median_cpu_ratio": sum(ratios) / 2}))
    lines = render_md.prefix_decode_section(tmp_path)
    assert "1024 shared + 16 own tokens against 1040 own tokens" in lines[0]
    assert "| float32 | 3.00 / 3.20 | 4.00 / 4.00 | 0.78 (0.75–0.80) | 0.78 | 2% |" in lines
    assert render_md.prefix_decode_section(tmp_path / "none") == []


def test_render_puts_the_run_under_its_machine_and_keeps_other_machines_sections(tmp_path):
    """One section per machine kind: a regenerated run sits under its own machine's heading, and
    the hand-written sections of other machines (between the machines markers) survive it."""
    results = tmp_path / "20261202-000000"
    results.mkdir()
    machine = {"cpu": "AMD EPYC", "cores": 2, "isa": ["avx2", "fma"], "memory_gib": 23.5, "kernel": "6.18",
               "python": "3.11.7", "kind": "AMD EPYC | 2 cores | avx2+fma"}
    (results / "run.json").write_text(json.dumps(
        {"started": "2026-12-02 00:00:00 UTC", "machine": machine, "load_before": [0.1, 0.1, 0.1],
         "load_after": [0.2, 0.2, 0.2], "minutes": 1.0, "threads": 2, "kvstrata_serve": ["--threads", "2"],
         "vllm_serve": ["--dtype", "float32"], "versions": {"torch": "2.13.0+cpu"}}))
    (results / "serve-shared-prefix.json").write_text(json.dumps(
        serve_results({"ttft": 2.0}, {"kvstrata": 0.8, "vllm": 0.4})))
    current = tmp_path / "BENCHMARKS.md"
    current.write_text("# Benchmarks\n\n<!-- notes:begin -->\nold notes\n<!-- notes:end -->\n\n"
                       "<!-- machines:begin -->\n## Some Xeon: int8, 2026-11-29\n\nkept\n<!-- machines:end -->\n")
    text = render_md.render(results, current)
    assert "\n## AMD EPYC | 2 cores | avx2+fma: `make bench`, 2026-12-02\n" in text
    assert "\n### Test configuration\n" in text and "\n## Test configuration\n" not in text
    assert "old notes" in text and "\n## Some Xeon: int8, 2026-11-29\n\nkept\n" in text
    assert text.index("make bench`, 2026-12-02") < text.index("## Some Xeon")
    served = text.index("\n### Served throughput and latency\n")
    assert served < text.index("Headline: requests/s and, in brackets, goodput") < text.index("\n#### shared-prefix\n")


def serve_results(slo: dict[str, float], goodputs: dict[str, float], old: bool = False) -> dict:
    """A served run's JSON as `kvstrata bench serve` writes it (`old`: from before requests in SLO were kept)."""
    from kvstrata.bench.metrics import RequestResult, RunMetrics

    summary = {}
    for label, good in goodputs.items():
        ttfts = [0.1 if i < good * 10 else 9.0 for i in range(10)]          # the first good * 10 meet the SLO
        results = [RequestResult(ok=True, prompt_tokens=8, output_tokens=4, ttft=t, e2el=t + 0.3) for t in ttfts]
        summary[label] = dataclasses.asdict(RunMetrics.of(results, 10.0, slo))
        if old:
            del summary[label]["slo_fraction"]
    return {"config": {"workload": "shared-prefix", "workload_params": {"input_len": 8}, "num_requests": 10,
                       "request_rate": 1.0, "repeats": 1, "slo_s": slo, "max_concurrency": None},
            "summary": summary, "runs": [{"label": label, "repeat": 0, "cpu_busy_before": 0.0} for label in goodputs]}


def test_served_tables_head_with_goodput_beside_throughput():
    slo = {"ttft": 2.0, "tpot": 0.25}
    served = [("shared-prefix", serve_results(slo, {"kvstrata": 0.8, "vllm": 0.4})), ("multi-turn", None),
              ("shared-prefix-saturated", serve_results({}, {"kvstrata": 1.0, "vllm": 1.0}))]
    lines = render_md.headline_section(served)
    assert "(ttft ≤ 2000 ms, tpot ≤ 250 ms;" in lines[0]
    assert lines[2] == "| run | kvstrata requests/s (goodput) | vllm requests/s (goodput) | kvstrata ÷ vllm, goodput |"
    assert lines[4] == "| shared-prefix | 1.000 (0.800) | 1.000 (0.400) | 2.00× |"
    assert lines[5] == "| shared-prefix-saturated | 1.000 (needs --slo) | 1.000 (needs --slo) | – |"
    table = render_md.serve_section("shared-prefix", served[0][1])
    assert "| goodput (requests/s in SLO) | 0.800 | 0.400 | 2.00× |" in table
    assert "| requests in SLO (share) | 0.800 | 0.400 | 2.00× |" in table
    assert "Goodput SLO: ttft ≤ 2000 ms, tpot ≤ 250 ms." in table[2]
    no_slo = render_md.serve_section("saturated", served[2][1])
    assert "| goodput (requests/s in SLO) | needs --slo | needs --slo | – |" in no_slo
    assert "Goodput SLO: none given (goodput needs `--slo`)." in no_slo[2]
    old = render_md.serve_section("old", serve_results(slo, {"kvstrata": 0.8, "vllm": 0.4}, old=True))
    assert "| requests in SLO (share) | – | – | – |" in old
