"""How many long conversations of a hybrid model the device KV holds while decoding: sliding layers keeping their
window only (KV groups, the default) against every layer at full length (`--swa-full`), in the same memory.

    .venv/bin/python benchmarks/swa_memory.py                        # Gemma 3 270M (the packaged file), 8,000 tokens
    .venv/bin/python benchmarks/swa_memory.py --context 2000 --full-conversations 1

The device cache is sized to hold `--full-conversations` conversations of `--context` tokens at full length
(every layer, every token). `--conversations` requests arrive at once, each a distinct prompt of `--context`
minus `--answer` tokens that then decodes `--answer` tokens (so each ends at `--context`), greedy, no host tier
or store (the engine's one tier is the point), no cut of prefill chunks for decodes' sake (`max_tpot_ms=0`: the
answers are long enough that every conversation admitted decodes beside the others, so memory, not the
prefill's pace, is what limits how many decode at once). Printed per setting: the most conversations decoding
at once (their whole prompt in the cache, sampling), the most holding KV at once, preemptions, the pages the
cache has and their size, the wall time; the ratio of conversations decoding at once; then one conversation's
decode step alone at `--context` tokens (p50), the two settings in turn for `--tpot-rounds` rounds. The
ceiling for Gemma 3 270M at 8,000 tokens is 18 x 8,000 / (3 x 8,000 + 15 x ~528) = ~4.5x (docs/design/model.md,
"KV cache groups").
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

from kvstrata.core.config import EngineConfig
from kvstrata.core.machine import machine
from kvstrata.core.request import RequestStatus
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.model.loader import load_model

logger = logging.getLogger("swa_memory")


def run(loaded, args, swa_full: bool, budget: int) -> dict:
    """One setting: every conversation added at once, stepped to the end; what the cache held at its fullest."""
    engine = LLMEngine(EngineConfig.from_options(kv_cache_memory=budget, swa_full=swa_full, max_num_seqs=64,
                                                 max_model_len=args.context, max_tpot_ms=0), loaded)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.answer, temperature=0, ignore_eos=True)
    for index in range(args.conversations):
        engine.add_request([rng.randrange(10, 200_000) for _ in range(args.context - args.answer)], params, str(index))
    started, decoding, holding, steps = time.perf_counter(), 0, 0, 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        running = [r for r in engine.scheduler.running if r.status is RequestStatus.RUNNING]
        decoding = max(decoding, sum(r.num_output_tokens > 0 for r in running))
        holding = max(holding, sum(engine.tiers.holds(r.request_id) for r in running))
        if steps % 200 == 0:
            logger.info("%s: step %d, %d decoding, %d holding KV, %s", "full" if swa_full else "window", steps,
                         decoding, holding, engine.tiers.device.counts())
    result = {"decoding": decoding, "holding": holding, "preemptions": engine.scheduler.num_preemptions,
              "pages": engine.tiers.device.num_blocks, "page_bytes": engine.runner.spec.bytes_per_block,
              "groups": engine.runner.kv_groups.num_groups, "seconds": time.perf_counter() - started}
    engine.close()
    return result


def one_stream_tpot(loaded, args, swa_full: bool, budget: int) -> float:
    """Median decode step (ms) of one conversation alone, its prompt `--context` minus 64 tokens (timed after it
    is in the cache, 64 tokens decoded): what KV groups cost or save a stream at long context."""
    engine = LLMEngine(EngineConfig.from_options(kv_cache_memory=budget, swa_full=swa_full,
                                                 max_model_len=args.context), loaded)
    rng = random.Random(1)
    engine.add_request([rng.randrange(10, 200_000) for _ in range(args.context - 64)],
                       SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    times = []
    while engine.has_unfinished:
        decoding = all(r.num_output_tokens > 0 for r in engine.scheduler.running)
        started = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - started)
    engine.close()
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--context", type=int, default=8000, help="tokens of each conversation at its end")
    parser.add_argument("--answer", type=int, default=512, help="tokens each conversation decodes")
    parser.add_argument("--full-conversations", type=int, default=2,
                        help="conversations at full length the device cache is sized for")
    parser.add_argument("--conversations", type=int, default=12, help="conversations sent at once")
    parser.add_argument("--tpot-rounds", type=int, default=3, help="rounds of the one-stream decode timing")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from kvstrata.core.config import ModelConfig
    loaded = load_model(ModelConfig(model=args.model))
    a = loaded.arch
    token_bytes = a.num_layers * 2 * a.num_kv_heads * a.head_dim * loaded.kv_dtype.itemsize
    block = 16
    budget = args.full_conversations * -(-args.context // block) * block * token_bytes
    print(f"# {machine()}")
    print(f"# {args.model}: {a.num_layers} layers ({sum(w is None for w in a.windows)} global, window "
          f"{a.sliding_window}), {token_bytes} bytes of KV a token at full length; "
          f"device cache {budget / 2**20:.0f} MiB "
          f"= {args.full_conversations} x {args.context} tokens at full length; {args.conversations} conversations "
          f"of {args.context} tokens ({args.answer} decoded)")
    results = {}
    for name, swa_full in (("full length (--swa-full)", True), ("window only (KV groups)", False)):
        r = results[name] = run(loaded, args, swa_full, budget)
        print(f"{name:26s} decoding at once {r['decoding']:3d}   holding KV {r['holding']:3d}   preemptions "
              f"{r['preemptions']:3d}   {r['pages']} pages of {r['page_bytes']} B in {r['groups']} group(s)   "
              f"{r['seconds']:.0f} s", flush=True)
    full, window = results.values()
    print(f"conversations decoding at once, window only / full length: {window['decoding'] / full['decoding']:.2f}x")
    tpot: dict[str, list[float]] = {name: [] for name in results}
    for _ in range(args.tpot_rounds):          # interleaved, so a neighbour's load falls on both alike
        for name, swa_full in (("full length (--swa-full)", True), ("window only (KV groups)", False)):
            tpot[name].append(one_stream_tpot(loaded, args, swa_full, budget))
    for name, times in tpot.items():
        print(f"{name:26s} one stream's decode step at {args.context} tokens, p50 of each round: "
              f"{', '.join(f'{t:.1f}' for t in times)} ms")


if __name__ == "__main__":
    main()
