"""Shared by the peers' offline scripts, which run in their own venvs without kvstrata installed:
the prompts file and the figures come from `kvstrata/bench/cases.py` (stdlib only), imported
from this checkout, so every engine is timed and reported the same way."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvstrata.bench.cases import CaseResult, OfflineCase, Speculation, digest, read_cases, time_case  # noqa: E402

__all__ = ["CaseResult", "OfflineCase", "Speculation", "digest", "emit", "parse_args", "read_cases", "time_case"]


def parse_args(description: str, more: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The flags every peer script takes, and `more(parser)`'s."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--prompts", required=True, help="prompts file written by benchmarks/run_all.py")
    parser.add_argument("--model", required=True, help="HF folder (transformers, vLLM) or GGUF file (llama.cpp)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", required=True, help="where to write the figures")
    parser.add_argument("--patience", type=float, default=0.0,
                        help="seconds each repeat may wait for other jobs to leave the cores")
    if more is not None:
        more(parser)
    return parser.parse_args()


def emit(path: str, engine: str, version: str, config: dict, results: list[CaseResult]) -> None:
    Path(path).write_text(json.dumps({"engine": engine, "version": version, "config": config,
                                      "cases": [asdict(r) for r in results]}, indent=1))
    for r in results:
        print(f"{engine} {r.name}: {r.output_tok_s:.1f} output tok/s, fastest repeat (median "
              f"{r.median_output_tok_s:.1f}; elapsed {r.elapsed_s}; others' CPU share before {r.cpu_busy})", flush=True)
