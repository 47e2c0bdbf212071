"""Decoding with a shared cached prefix against distinct cached contexts, through the `LLM` API.

    .venv/bin/python benchmarks/shared_prefix_decode.py              # 16 x (1,024 shared + 16 own) vs 16 x 1,040
    .venv/bin/python benchmarks/shared_prefix_decode.py --seqs 16 --prefix 1024 --own 16 --tokens 64 --repeat 3

Two cases of --seqs prompts each, the same length (prefix + own tokens):
    shared     every prompt starts with the same --prefix tokens, then --own tokens of its own;
    distinct   every prompt is --prefix + --own tokens of its own.
Both are cached first (one generated token each), so each timed run computes one prompt token
per sequence and then decodes: it times `LLM.generate` of --tokens greedy tokens (EOS ignored)
for all sequences at once. Runs alternate (shared, distinct, shared, ...) in one process; the
figure is shared / distinct per pair and its median, in wall time and in this process's CPU time
(with --threads 1 the CPU time barely moves when other jobs share the cores). Also prints the cached share of the
prompts in each timed run (1.0 less one token per sequence when the cache held them all), and
how busy other jobs kept the cores just before it (each run first waits up to --patience
seconds for them to quieten; see kvstrata.bench.quiet). --json writes every run and the medians
(`make bench` renders them into BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstrata.bench.quiet import wait_quiet
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm import LLM


def prompts(case: str, seqs: int, prefix: int, own: int, rng: random.Random) -> list[list[int]]:
    """Token ids from an ordinary range of SmolLM2's vocabulary (no special tokens)."""
    def draw(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]
    shared = draw(prefix)
    return [(shared if case == "shared" else draw(prefix)) + draw(own) for _ in range(seqs)]


@dataclass
class Run:
    seconds: float
    cpu_seconds: float             # of this process, all threads
    cached: float                  # share of the prompt tokens found in the cache
    busy: float                    # share of the cores other jobs used just before
    digest: str                    # of every generated token id: equal digests, equal outputs


def timed(llm: LLM, batch: list[list[int]], tokens: int, patience: float = 0.0) -> Run:
    """One generate call of `tokens` greedy tokens per prompt."""
    busy = wait_quiet(patience)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(batch, params)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    assert all(o.num_output_tokens == tokens for o in outputs), "every sequence decodes --tokens tokens"
    digest = hashlib.sha256(repr([o.new_token_ids for o in outputs]).encode()).hexdigest()[:12]
    return Run(seconds, cpu_seconds, sum(o.num_cached_tokens for o in outputs) / sum(len(p) for p in batch), busy, digest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=1024, help="shared tokens (shared case)")
    parser.add_argument("--own", type=int, default=16, help="tokens of each prompt's own after the prefix")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens generated per sequence")
    parser.add_argument("--repeat", type=int, default=3, help="timed pairs (shared, distinct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--patience", type=float, default=60.0, help="seconds to wait for quiet cores per run")
    parser.add_argument("--json", type=Path, default=None, help="write the runs and medians here")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    cases = {case: prompts(case, args.seqs, args.prefix, args.own, rng) for case in ("shared", "distinct")}
    context = args.prefix + args.own + args.tokens
    llm = LLM(dtype=args.dtype, threads=args.threads, max_num_seqs=args.seqs,
              max_model_len=context + 16, kv_cache_memory="1536MiB")
    for batch in cases.values():
        timed(llm, batch, 1)                                     # caches every full block of every prompt
    print(f"{args.seqs} sequences x {args.tokens} greedy tokens; shared: {args.prefix} shared + {args.own} own "
          f"tokens, distinct: {args.prefix + args.own} own tokens; {args.threads} threads, {args.dtype}")
    ratios, cpu_ratios, pairs = [], [], []
    for r in range(args.repeat):
        runs = {case: timed(llm, batch, args.tokens, args.patience) for case, batch in cases.items()}
        pairs.append({case: asdict(run) for case, run in runs.items()})
        ratios.append(runs["shared"].seconds / runs["distinct"].seconds)
        cpu_ratios.append(runs["shared"].cpu_seconds / runs["distinct"].cpu_seconds)
        print(f"  pair {r}: " + "  ".join(f"{case} {run.seconds:6.2f} s, CPU {run.cpu_seconds:6.2f} s (cached "
                                          f"{run.cached:.3f}, others {run.busy:.0%}, tokens {run.digest})"
                                          for case, run in runs.items())
              + f"  shared / distinct {ratios[-1]:.2f} (CPU {cpu_ratios[-1]:.2f})", flush=True)
    for what, values in (("wall", ratios), ("CPU", cpu_ratios)):
        print(f"median shared / distinct, {what} time: {statistics.median(values):.2f} "
              f"(min {min(values):.2f}, max {max(values):.2f})")
    if args.json:
        args.json.write_text(json.dumps({"seqs": args.seqs, "prefix": args.prefix, "own": args.own,
                                         "tokens": args.tokens, "threads": args.threads, "dtype": args.dtype,
                                         "pairs": pairs, "ratios": ratios, "cpu_ratios": cpu_ratios,
                                         "median_ratio": statistics.median(ratios),
                                         "median_cpu_ratio": statistics.median(cpu_ratios)}, indent=1))


if __name__ == "__main__":
    main()
