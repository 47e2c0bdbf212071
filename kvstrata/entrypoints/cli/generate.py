"""`kvstrata generate`: complete prompts in-process and print figures."""

from __future__ import annotations

import argparse
import sys
import time

from kvstrata.entrypoints.flags import add_engine_flags, engine_config


def add_generate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("generate", help="complete prompts in-process and print figures")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text; repeat the flag to run several one after another (later ones "
                             "can reuse the KV of earlier ones)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    add_engine_flags(parser)
    parser.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from kvstrata.core.sampling_params import SamplingParams
    from kvstrata.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    for text in args.prompt:
        prompt = engine.chat_prompt([{"role": "user", "content": text}]) if args.chat else text
        request = engine.add_request(prompt, params)
        started = time.perf_counter()
        first = None
        while engine.has_unfinished:
            for out in engine.step():
                first = first or time.perf_counter()
                print(out.text, end="", flush=True)
        ended = time.perf_counter()
        print()
        computed = request.num_prompt_tokens - request.num_cached_tokens
        decode_rate = (request.num_output_tokens - 1) / (ended - first) if ended > first else float("nan")
        print(f"[{request.num_prompt_tokens} prompt tokens ({request.num_cached_tokens} cached) in "
              f"{first - started:.3f}s: {computed / (first - started):.1f} tok/s | {request.num_output_tokens} "
              f"output tokens: {decode_rate:.1f} tok/s decode | finish: {request.status.finish_reason}]",
              file=sys.stderr)
    engine.close()          # with a store, what this run cached is written there for the next run
    return 0
