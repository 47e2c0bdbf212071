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

from kvstrata.bench.cases import CaseResult, OfflineCase, Speculation, digest, time_case
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
    predicted = {tuple(p): q for ps, qs in zip(case.repeats, case.predictions or ()) for p, q in zip(ps, qs)}
    steps, drafts, digests = [], [], []

    def generate(prompts: list[list[int]]) -> None:
        before, counted = engine.stats.steps, _speculation(engine)
        outputs = _generate(engine, prompts, [predicted.get(tuple(p)) for p in prompts], params)
        steps.append(engine.stats.steps - before)
        drafts.append(_speculation(engine, since=counted))
        assert all(len(o) == case.output_len for o in outputs), "an output stopped early"
        digests.append(digest(outputs))

    result = time_case(case, generate, patience)
    fastest = result.elapsed_s.index(min(result.elapsed_s))
    result.steps = steps[fastest]
    result.weight_gb_s = weight_bytes(engine.runner.model) * result.steps / result.elapsed_s[fastest] / 1e9
    result.speculation = drafts[fastest] if drafts[fastest].drafts else None
    result.output_digests = digests
    return result


def _generate(engine: LLMEngine, prompts: list[list[int]], predictions: list[list[int] | None],
              params: SamplingParams) -> list[list[int]]:
    """Every prompt to completion (each with its prediction, if any); output token ids in prompt order."""
    ids = [engine.add_request(p, params, prediction=q).request_id for p, q in zip(prompts, predictions)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids]


def _speculation(engine: LLMEngine, since: Speculation | None = None) -> Speculation:
    """The engine's spec-decode counters (minus `since`'s)."""
    stats, zero = engine.stats, since or Speculation(0, 0, 0)
    return Speculation(stats.spec_decode_num_drafts - zero.drafts,
                       stats.spec_decode_num_draft_tokens - zero.draft_tokens,
                       stats.spec_decode_num_accepted_tokens - zero.accepted_tokens)


def run_offline(engine: LLMEngine, cases: list[OfflineCase], patience: float = 0.0) -> dict:
    """Warm up, time every case, measure memory bandwidth; a JSON-ready dict."""
    engine.generate([[TOKEN_LOW + i for i in range(16)]] * 2, SamplingParams(max_tokens=8, temperature=0.0))
    while engine.map_kv_pages(MAP_CHUNK_BYTES):
        pass
    results = [run_case(engine, case, patience) for case in cases]
    wait_quiet(patience, "memory bandwidth")
    return {"engine": "kvstrata", "weight_bytes": weight_bytes(engine.runner.model),
            "dtype": str(engine.loaded.dtype).removeprefix("torch."), "quantization": engine.loaded.quantization,
            "runs": engine.loaded.runs(),
            "memory_read_gb_s": memory_read_bandwidth() / 1e9,
            "config": asdict(engine.config), "cases": [asdict(r) for r in results]}
