"""Where an engine step's time goes at several batch sizes: scheduling, the model, bookkeeping.

Runs the real engine on the default model, B requests decoding together (a short prompt each, then
greedy tokens with EOS ignored), and splits the decode steps' wall time into scheduling
(`Scheduler.schedule`, admission), the model and sampler, and the rest (ledger updates, block
caching, detokenization, outputs). The Python work per request per step is what grows with B:

    .venv/bin/python benchmarks/step_overhead.py --batches 1 16 64
"""

from __future__ import annotations

import argparse

from kvstrata.core.config import EngineConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine


def measure(engine: LLMEngine, batch: int, prompt_tokens: int, decode_steps: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=decode_steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + t) % 1000 + 10 for t in range(prompt_tokens)], params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()                                   # prefill
    engine.step()
    before = (engine.stats.steps, engine.stats.step_seconds, engine.stats.schedule_seconds, engine.stats.model_seconds)
    for _ in range(decode_steps):
        engine.step()
    steps, total, schedule, model = (now - then for now, then in zip(
        (engine.stats.steps, engine.stats.step_seconds, engine.stats.schedule_seconds, engine.stats.model_seconds),
        before))
    while engine.has_unfinished:
        engine.step()
    return {"step_ms": 1000 * total / steps, "schedule": schedule / total, "model": model / total,
            "bookkeeping": (total - schedule - model) / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig.from_options(kv_cache_memory="512MiB", max_num_seqs=max(args.batches),
                                                 threads=args.threads))
    measure(engine, 2, args.prompt_tokens, 4)          # warm-up: first steps pay for torch's set-up
    print(f"{'batch':>6}{'step ms':>10}{'schedule':>10}{'model':>9}{'bookkeeping':>13}{'sched+book':>12}")
    for batch in args.batches:
        row = measure(engine, batch, args.prompt_tokens, args.decode_steps)
        print(f"{batch:>6}{row['step_ms']:>10.1f}{row['schedule']:>10.2%}{row['model']:>9.1%}"
              f"{row['bookkeeping']:>13.2%}{row['schedule'] + row['bookkeeping']:>12.2%}")


if __name__ == "__main__":
    main()
