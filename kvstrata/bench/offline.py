"""Offline throughput: prompts through `LLMEngine`, timed from submission to the last token.

Cases (`cases.py`) come from a prompts file, so peers in other venvs run the very same token ids
(`benchmarks/peers/offline_*.py`), or are drawn here. Each repeat waits for a quiet machine first
(`quiet.py`); the model load and a short warm-up are not timed. The warm-up also maps every page
of the KV cache: vLLM zero-fills its cache when it allocates it, and our server maps the pages
while idle (`LLMEngine.map_kv_pages`), so neither pays the first write to a fresh page inside a
timed run (a batch-32 case of 128 + 128 tokens would pay ~0.5 s of faults; BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from kvstrata.bench.cases import CaseResult, OfflineCase, time_case
from kvstrata.bench.quiet import wait_quiet
from kvstrata.bench.roofline import memory_read_bandwidth, weight_bytes
from kvstrata.bench.workloads import TOKEN_HIGH, TOKEN_LOW
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.async_engine import MAP_CHUNK_BYTES
from kvstrata.engine.llm_engine import LLMEngine


def make_cases(batch_sizes: list[int], input_len: int, output_len: int, repeats: int, seed: int) -> list[OfflineCase]:
    rng = np.random.default_rng([seed, 11])
    return [OfflineCase(f"batch {n}", output_len,
                        [[rng.integers(TOKEN_LOW, TOKEN_HIGH, input_len).tolist() for _ in range(n)]
                         for _ in range(repeats)]) for n in batch_sizes]


def run_case(engine: LLMEngine, case: OfflineCase, patience: float) -> CaseResult:
    params = SamplingParams(max_tokens=case.output_len, min_tokens=case.output_len, temperature=0.0, ignore_eos=True)
    steps = []

    def generate(prompts: list[list[int]]) -> None:
        before = engine.stats.steps
        outputs = engine.generate(prompts, params)
        steps.append(engine.stats.steps - before)
        assert all(o.num_output_tokens == case.output_len for o in outputs), "an output stopped early"

    result = time_case(case, generate, patience)
    fastest = result.elapsed_s.index(min(result.elapsed_s))
    result.steps = steps[fastest]
    result.weight_gb_s = weight_bytes(engine.runner.model) * result.steps / result.elapsed_s[fastest] / 1e9
    return result


def run_offline(engine: LLMEngine, cases: list[OfflineCase], patience: float = 0.0) -> dict:
    """Warm up, time every case, measure memory bandwidth; a JSON-ready dict."""
    engine.generate([[TOKEN_LOW + i for i in range(16)]] * 2, SamplingParams(max_tokens=8, temperature=0.0))
    while engine.map_kv_pages(MAP_CHUNK_BYTES):
        pass
    results = [run_case(engine, case, patience) for case in cases]
    wait_quiet(patience, "memory bandwidth")
    return {"engine": "kvstrata", "weight_bytes": weight_bytes(engine.runner.model),
            "dtype": str(engine.loaded.dtype).removeprefix("torch."), "quantization": engine.loaded.quantization,
            "memory_read_gb_s": memory_read_bandwidth() / 1e9,
            "config": asdict(engine.config), "cases": [asdict(r) for r in results]}
