"""BENCHMARKS.md's host probe and shared-prefix decode sections, rendered from results files as
`benchmarks/run_all.py` writes them (the scripts in benchmarks/ are not a package: loaded by path)."""

from __future__ import annotations

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
    current = tmp_path / "BENCHMARKS.md"
    current.write_text("# Benchmarks\n\n<!-- notes:begin -->\nold notes\n<!-- notes:end -->\n\n"
                       "<!-- machines:begin -->\n## Some Xeon: int8, 2026-11-29\n\nkept\n<!-- machines:end -->\n")
    text = render_md.render(results, current)
    assert "\n## AMD EPYC | 2 cores | avx2+fma: `make bench`, 2026-12-02\n" in text
    assert "\n### Test configuration\n" in text and "\n## Test configuration\n" not in text
    assert "old notes" in text and "\n## Some Xeon: int8, 2026-11-29\n\nkept\n" in text
    assert text.index("make bench`, 2026-12-02") < text.index("## Some Xeon")
