"""n samples in one request (a family: one prefill) against n separate requests of the same prompt.

    .venv/bin/python benchmarks/parallel_sampling.py                 # 512-token prompt, n=4, 32 tokens each
    .venv/bin/python benchmarks/parallel_sampling.py --prompt 500 --n 4 --tokens 32 --repeat 3

Three cases, each on a fresh engine (an empty cache), with the same prompt and seeds:
    family     one request with n samples: the prompt is computed once, the samples fork from it
               (shared full blocks, a copy of the partly filled last one);
    separate   n requests added at once, prefix caching on: the first computes the prompt, the
               others wait for its blocks and hit them, but each recomputes its last block (the last
               prompt token is always computed, for its logits);
    no_cache   n requests with prefix caching off: every one computes the whole prompt.
Each run times `LLMEngine.generate` of --tokens sampled tokens per sequence (EOS ignored), and
reads the engine's `prompt_tokens_computed`. Cases rotate within each repeat, in one process; the
figures are the medians (wall time, and this process's CPU time, which barely moves when other jobs
share the cores with --threads 1) and the ratios to `family`, and how busy other jobs kept the cores just
before each run (each run first waits up to --patience seconds for them to quieten).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from dataclasses import dataclass

from kvstrata.bench.quiet import wait_quiet
from kvstrata.core.config import EngineConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.model.loader import load_model

CASES = ("family", "separate", "no_cache")


@dataclass
class Run:
    seconds: float
    cpu_seconds: float             # of this process, all threads: steadier than wall time on a busy machine
    prompt_tokens_computed: int
    output_tokens: int
    busy: float


def run(loaded, case: str, prompt: list[int], n: int, tokens: int, seed: int, options: dict,
        patience: float) -> Run:
    engine = LLMEngine(EngineConfig.from_options(enable_prefix_caching=case != "no_cache", **options), loaded=loaded)
    base = SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, ignore_eos=True)
    busy = wait_quiet(patience)
    start, cpu_start = time.perf_counter(), time.process_time()
    if case == "family":
        outputs = engine.generate([prompt], dataclasses.replace(base, n=n))
    else:
        for index in range(n):          # the seeds the family's samples use: seed + index
            engine.add_request(prompt, dataclasses.replace(base, seed=seed + index))
        outputs = []
        while engine.has_unfinished:
            outputs += [out for out in engine.step() if out.finished]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    assert len(outputs) == n and all(out.num_output_tokens == tokens for out in outputs)
    return Run(seconds, cpu_seconds, engine.stats.prompt_tokens_computed,
               sum(out.num_output_tokens for out in outputs), busy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--n", type=int, default=4, help="samples")
    parser.add_argument("--tokens", type=int, default=32, help="sampled tokens per sample")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--patience", type=float, default=30.0, help="seconds to wait for quiet cores per run")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt)]   # ordinary tokens of SmolLM2's vocabulary
    options = dict(dtype=args.dtype, threads=args.threads, block_size=args.block_size, kv_cache_memory="256MiB",
                   max_model_len=args.prompt + args.tokens + 16)
    loaded = load_model(EngineConfig.from_options(**options).model)
    print(f"prompt {args.prompt} tokens, n={args.n}, {args.tokens} sampled tokens each, block size "
          f"{args.block_size}, {args.threads} threads, {args.dtype}")
    runs: dict[str, list[Run]] = {case: [] for case in CASES}
    for r in range(args.repeat):
        order = CASES[r % len(CASES):] + CASES[:r % len(CASES)]
        for case in order:
            result = run(loaded, case, prompt, args.n, args.tokens, args.seed, options, args.patience)
            runs[case].append(result)
            print(f"  repeat {r} {case:9s} {result.seconds:6.2f} s (CPU {result.cpu_seconds:6.2f} s), "
                  f"prompt tokens computed "
                  f"{result.prompt_tokens_computed:5d}, output tokens {result.output_tokens}, others {result.busy:.0%}",
                  flush=True)
    family = statistics.median(run.seconds for run in runs["family"])
    family_cpu = statistics.median(run.cpu_seconds for run in runs["family"])
    for case in CASES:
        seconds = statistics.median(run.seconds for run in runs[case])
        cpu = statistics.median(run.cpu_seconds for run in runs[case])
        computed = statistics.median(run.prompt_tokens_computed for run in runs[case])
        print(f"{case:9s} median {seconds:6.2f} s ({seconds / family:.2f}x family), CPU {cpu:6.2f} s "
              f"({cpu / family_cpu:.2f}x), prompt tokens computed {computed:.0f} "
              f"({computed / args.prompt:.2f}x the prompt)")


if __name__ == "__main__":
    main()
