"""What structured output costs a sampling step: the Sampler at batch 1 and 32, with and without grammars.

Each configuration samples `--steps` steps from random (B, V) logits at temperature 1 through the
real `Sampler` with its `GrammarMasker` (llguidance, SmolLM2's tokenizer): "free" rows have no
grammar, "json" rows grammar_libs.py's nested JSON schema, "regex" rows `[a-z ]{300}` (a grammar
llguidance's token slices do not cover, so its mask walks the whole vocabulary). Sampled tokens go into each request's ledger, so the
matchers advance as in serving; a request that ends its JSON starts a new one (not timed). The
configurations alternate within each repeat, so the shared machine's noise falls on all alike; the
figure is the median step, and `mask` is the masker's share of it (fill, unpack, apply).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/structured_mask.py --steps 40 --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from grammar_libs import SCHEMA  # the library comparison's schema (the script's folder is on sys.path)

from kvstrata.core.config import ModelConfig
from kvstrata.core.hashing import BlockHasher
from kvstrata.core.request import Request
from kvstrata.core.sampling_params import GrammarSpec, SamplingParams
from kvstrata.model.loader import load_model
from kvstrata.structured.grammar import GrammarMasker
from kvstrata.worker.sampler import Sampler


class _Timed:
    """Wraps GrammarMasker.mask to add up its time."""

    def __init__(self, masker: GrammarMasker):
        self.masker, self.seconds = masker, 0.0

    def mask(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.masker.mask(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


SPECS = {"free": None, "json": GrammarSpec.json_schema(SCHEMA, "response_format"),
         "regex": GrammarSpec("regex", "[a-z ]{300}")}


def run(sampler: Sampler, timed: _Timed, batch: int, kind: str, steps: int, vocab: int,
        eos: tuple[int, ...], ids: itertools.count) -> tuple[float, float]:
    """(median step ms, median mask ms) over `steps` steps of `batch` requests."""
    spec = SPECS[kind]
    params = SamplingParams(max_tokens=10_000, temperature=1.0, structured=spec)
    hasher = BlockHasher.create(16, "bench")

    def fresh() -> Request:
        return Request(f"r{next(ids)}", [1, 2, 3], params, hasher)

    requests = [fresh() for _ in range(batch)]
    step_times, mask_times = [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab)
        timed.seconds = 0.0
        started = time.perf_counter()
        out = sampler(logits, requests)
        step_times.append(time.perf_counter() - started)
        mask_times.append(timed.seconds)
        for i, token in enumerate(out.token_ids):
            if token in eos:
                requests[i] = fresh()
            else:
                requests[i].append_output(token)
    return statistics.median(step_times) * 1e3, statistics.median(mask_times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(dtype="float32", device="cpu"))
    vocab = loaded.arch.vocab_size
    timed = _Timed(GrammarMasker(loaded.tokenizer, vocab, loaded.eos_token_ids))
    sampler = Sampler(loaded.eos_token_ids, seed=0, grammars=timed)
    ids = itertools.count()
    run(sampler, timed, 2, "json", 4, vocab, loaded.eos_token_ids, ids)        # warm-up: tokenizer view, caches
    configs = [(b, kind) for b in args.batch for kind in SPECS]
    results: dict[tuple[int, str], list[tuple[float, float]]] = {c: [] for c in configs}
    for repeat in range(args.repeats):
        for config in configs if repeat % 2 == 0 else configs[::-1]:
            results[config].append(run(sampler, timed, *config, args.steps, vocab, loaded.eos_token_ids, ids))
    print(f"sampler step at temperature 1, V={vocab}; median of {args.repeats} runs of {args.steps} steps "
          f"({torch.get_num_threads()} torch threads)")
    print(f"{'batch':>5} {'rows':>5} {'step ms':>8} {'mask ms':>8} {'vs free':>8}")
    for batch in args.batch:
        free = statistics.median(r[0] for r in results[(batch, "free")])
        for kind in SPECS:
            step = statistics.median(r[0] for r in results[(batch, kind)])
            mask = statistics.median(r[1] for r in results[(batch, kind)])
            print(f"{batch:>5} {kind:>5} {step:>8.3f} {mask:>8.3f} {step / free:>7.2f}x")


if __name__ == "__main__":
    main()
