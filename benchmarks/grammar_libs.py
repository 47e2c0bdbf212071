"""xgrammar against llguidance: the per-step cost of a token mask on this CPU, with SmolLM2's tokenizer.

Why this exists: structured output needs one grammar library, and the one to keep is the one whose
mask costs a decode step least at the batch sizes we serve. Each step of a run, for B matchers of
the same JSON schema (each at its own position: they pick different allowed tokens), it times
  fill   the (B, V/32) bitmask (xgrammar: BatchGrammarMatcher; llguidance: the parallel executor),
  apply  the bitmask to (B, V) float32 logits,
  accept one allowed token per matcher (chosen at random from the mask, not timed),
and it reports the median per step, plus the compile time of the schema. Libraries alternate
run by run (--repeats), so the shared machine's noise falls on both alike.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/grammar_libs.py --batch 1 32 --steps 48 --repeats 3

xgrammar is not a dependency; install it without its triton requirement first:
    .venv/bin/pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvstrata.core.config import ModelConfig
from kvstrata.model.loader import load_model

# Nested objects, enums, arrays, numbers: the shape of an extraction request.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["city", "river", "mountain"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                  "required": ["lat", "lon"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "where"],
    "additionalProperties": False,
}


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = ((bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


class XGrammarLib:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema, any_whitespace=False)

    def matchers(self, compiled, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int, vocab: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, vocab)

    def fill(self, matchers: list, bitmask: torch.Tensor, parallel: bool) -> None:
        if parallel:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, i)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class LLGuidanceLib:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos[0])
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema: str):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        assert not error, error
        return grammar

    def matchers(self, compiled, n: int) -> list:
        return [self.ll.LLMatcher(self.tokenizer, compiled) for _ in range(n)]

    def bitmask(self, n: int, vocab: int) -> torch.Tensor:
        return self.ll.torch.allocate_token_bitmask(n, vocab)

    def fill(self, matchers: list, bitmask: torch.Tensor, parallel: bool) -> None:
        if parallel:
            self.ll.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                                      bitmask)
        else:
            for i, matcher in enumerate(matchers):
                self.ll.torch.fill_next_token_bitmask(matcher, bitmask, i)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.ll.torch.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


def run(lib, batch: int, parallel: bool, steps: int, vocab: int, seed: int) -> dict:
    """Median fill and apply time per step (ms) for `batch` matchers, and the compile time (ms)."""
    schema = json.dumps(SCHEMA)
    started = time.perf_counter()
    compiled = lib.compile(schema)
    compile_ms = (time.perf_counter() - started) * 1e3
    matchers = lib.matchers(compiled, batch)
    bitmask = lib.bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    rng = random.Random(seed)
    fills, applies = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask, parallel)
        t1 = time.perf_counter()
        lib.apply(logits, bitmask)
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        applies.append(t2 - t1)
        for i, matcher in enumerate(matchers):
            if lib.done(matcher):        # finished JSON: start the document again
                matchers[i] = matcher = lib.matchers(compiled, 1)[0]
                continue
            lib.accept(matcher, rng.choice(_allowed(bitmask[i], vocab)))
    return {"compile_ms": compile_ms, "fill_ms": statistics.median(fills) * 1e3,
            "apply_ms": statistics.median(applies) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model(ModelConfig(dtype="float32", device="cpu"))
    tokenizer, vocab, eos = loaded.tokenizer, loaded.arch.vocab_size, loaded.eos_token_ids
    libs = [XGrammarLib(tokenizer, vocab, list(eos)), LLGuidanceLib(tokenizer, vocab, list(eos))]
    modes = [(batch, parallel) for batch in args.batch for parallel in ((False, True) if batch > 1 else (False,))]
    results: dict[tuple[str, int, bool], list[dict]] = {}
    for repeat in range(args.repeats):
        for batch, parallel in modes:
            for lib in libs if repeat % 2 == 0 else libs[::-1]:
                results.setdefault((lib.name, batch, parallel), []).append(
                    run(lib, batch, parallel, args.steps, vocab, repeat))
    print(f"{'library':<11} {'batch':>5} {'fill':>9} {'compile ms':>11} {'fill ms/step':>13} {'apply ms/step':>14}  "
          f"(median of {args.repeats} runs of {args.steps} steps, {torch.get_num_threads()} torch threads)")
    for (name, batch, parallel), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        print(f"{name:<11} {batch:>5} {'2 threads' if parallel else 'in turn':>9} {med['compile_ms']:>11.2f} "
              f"{med['fill_ms']:>13.3f} {med['apply_ms']:>14.3f}")


if __name__ == "__main__":
    main()
