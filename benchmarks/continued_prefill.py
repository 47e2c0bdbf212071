"""Time a prefill chunk after a cached prefix of s tokens, on the real engine, against the profile.

    .venv/bin/python benchmarks/continued_prefill.py                         the default grid, 3 rounds
    .venv/bin/python benchmarks/continued_prefill.py --prefixes 0 256 768 --chunks 64 256 --rounds 5

Each point is one whole engine step, as `kvstrata calibrate` times them (engine-thread CPU time,
1 thread, KV pages mapped first): a request of s cached tokens plus n fresh ones, alone. Rounds
visit the points in a new random order each time, so drift and neighbours spread over all of them;
each point keeps its median. Printed per point: the batch shape's terms, the measured step, what
the profile charges (`CostModel.step_seconds`) and the error, so one sees whether the profile's
terms follow the cost of a chunk that continues a sequence (masked attention over its gathered
blocks) as its size n and the context before it s change.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np

from kvstrata.calibration.engine_replay import BLOCK_SIZE, MAX_CHUNK, ShapeRecorder, warm_up
from kvstrata.core.config import EngineConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.sim.batch_shape import BatchShape
from kvstrata.sim.cost_model import CostModel

PREFIXES = (0, 32, 128, 256, 512, 768, 1008)
CHUNKS = (16, 64, 128, 256, 512, 1024)


def measure(prefixes, chunks, rounds: int, threads: int, seed: int = 0) -> list[dict]:
    engine = LLMEngine(EngineConfig.from_options(block_size=BLOCK_SIZE, kv_cache_memory="512MiB",
                                                 max_model_len=4096, max_num_batched_tokens=MAX_CHUNK,
                                                 threads=threads))
    recorder = ShapeRecorder(engine.runner)
    engine.runner = recorder
    warm_up(engine)
    rng, vocab = np.random.default_rng(seed), engine.loaded.arch.vocab_size
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    shared = {s: rng.integers(0, vocab, s).tolist() for s in prefixes}
    points = [(s, n) for s in prefixes for n in chunks if s + n <= MAX_CHUNK + 16 and n <= MAX_CHUNK]
    times: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    shapes: dict[tuple[int, int], BatchShape] = {}
    order = random.Random(seed)
    try:
        for _ in range(rounds):
            order.shuffle(points)
            for s, n in points:
                if s:                          # (re)cache the prefix: an earlier point may have evicted it
                    engine.add_request(shared[s] + rng.integers(0, vocab, 1).tolist(), one)
                    while engine.has_work:
                        engine.step()
                engine.add_request(shared[s] + rng.integers(0, vocab, n).tolist(), one)
                started = time.thread_time()
                engine.step()
                seconds = time.thread_time() - started
                shape = recorder.last
                assert shape == BatchShape.alone(s, n, BLOCK_SIZE), f"({s}, {n}) ran as {shape}"
                shapes[s, n] = shape
                times[s, n].append(seconds)
                while engine.has_work:
                    engine.step()
    finally:
        engine.close()
    return [{"prefix": s, "chunk": n, "shape": shapes[s, n]._asdict(), "seconds": statistics.median(times[s, n]),
             "spread": max(times[s, n]) / min(times[s, n]) - 1} for s, n in sorted(points)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", nargs="+", type=int, default=list(PREFIXES))
    parser.add_argument("--chunks", nargs="+", type=int, default=list(CHUNKS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", default="benchmarks/profiles/cpu-2core-smollm2.json")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if any(s % BLOCK_SIZE for s in args.prefixes):
        parser.error(f"prefixes must be whole blocks of {BLOCK_SIZE} tokens, or the cache hits fewer")
    cost = CostModel.load(args.profile)
    started = time.perf_counter()
    rows = measure(args.prefixes, args.chunks, args.rounds, args.threads)
    print(f"{len(rows)} points x {args.rounds} rounds in {time.perf_counter() - started:.0f} s; "
          f"profile {args.profile}")
    print(f"{'prefix':>6} {'chunk':>5} {'keys':>5} {'step ms':>8} {'spread':>6} {'profile ms':>10} {'error':>7}")
    for row in rows:
        shape = BatchShape(**row["shape"])
        predicted = cost.step_seconds(shape)
        row["profile_s"] = predicted
        keys = shape.kv_tokens_read
        print(f"{row['prefix']:6d} {row['chunk']:5d} {keys:5d} {row['seconds'] * 1e3:8.1f} {row['spread']:6.1%} "
              f"{predicted * 1e3:10.1f} {predicted / row['seconds'] - 1:+7.1%}")
    if args.output_json:
        with open(args.output_json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
