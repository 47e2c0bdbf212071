"""`kvstrata generate | serve | ...`: the command line (engine flags come from `kvstrata.flags`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time

from kvstrata.bench.cli import add_bench
from kvstrata.config import ServerConfig
from kvstrata.flags import add_engine_flags, add_section_flags, engine_config
from kvstrata.routing.proxy import add_router
from kvstrata.sim.cli import add_calibrate, add_simulate

# ---- generate -----------------------------------------------------------------------------------
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
    from kvstrata.engine import LLMEngine
    from kvstrata.request import SamplingParams

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


# ---- serve --------------------------------------------------------------------------------------
def add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model, as --model (vllm serve MODEL)")
    add_section_flags(parser, "server", ServerConfig)
    add_engine_flags(parser)
    parser.set_defaults(run=run_serve, default_log_level="INFO")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvstrata.engine import AsyncLLMEngine, LLMEngine
    from kvstrata.faults import ENV_VAR, FaultInjector
    from kvstrata.server import create_app

    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise ValueError(f"two models given: {args.model_arg} and --model {args.model}")
        args.model = args.model_arg
    server = ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)}).validate()
    started = time.monotonic()
    faults = FaultInjector.from_env()
    if faults is not None:
        logging.getLogger("kvstrata").warning("%s is set: injecting faults %s", ENV_VAR, faults.every)
    engine_settings = engine_config(args)
    # Loaded on the engine thread, so one OpenMP team runs every step (see AsyncLLMEngine).
    async_engine = AsyncLLMEngine(lambda: LLMEngine(engine_settings, faults=faults)).start()
    engine = async_engine.engine
    name = server.served_model_name or engine.loaded.name
    app = create_app(async_engine, name, server.api_key, server.max_queue, server.origins)
    # uvicorn stops accepting on SIGTERM/SIGINT, lets open requests run for shutdown_timeout seconds,
    # then cancels them (which aborts their requests); what is left is aborted below. Once done it
    # re-raises the signal into the handlers it found: these, so the process goes on to exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=server.shutdown_timeout, access_log=False)
    ready_server(config, f"serving {name} on http://{server.host}:{server.port} (OpenAI API under /v1), "
                        f"ready {time.monotonic() - started:.1f}s after loading began").run()
    log = logging.getLogger("kvstrata")
    log.info("shutting down: %d requests in flight", async_engine.num_unfinished)
    async_engine.shutdown()
    stats = engine.tiers.stats
    log.info("stopped: %d steps, %d prompt tokens (%d from cache), %d tokens generated; %d blocks written to "
             "the store, %d not", engine.stats.steps, stats.prompt_tokens, sum(stats.hit_tokens.values()),
             engine.stats.generated_tokens, stats.offloaded_blocks["store"], engine.tiers.num_unpersisted)
    return 0


def ready_server(config, ready_line: str):
    """A uvicorn server that logs `ready_line` once its socket accepts connections, not before."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                logging.getLogger("kvstrata").warning("%s", ready_line)

    return _Server(config)


# ---- entry --------------------------------------------------------------------------------------
COMMANDS = [add_generate, add_serve, add_router, add_simulate, add_calibrate, add_bench]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _add_log_level(parser: argparse.ArgumentParser, default: str | None) -> None:
    """--log-level before or after the command (and its sub-commands): the last one given wins."""
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        default=default if default is not None else argparse.SUPPRESS,
                        help="log level (default: INFO for serve, WARNING otherwise)")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _add_log_level(sub, None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstrata", description="LLM serving with a three-tier KV cache")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(commands)
    _add_log_level(parser, None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.log_level = getattr(args, "log_level", None) or getattr(args, "default_log_level", "WARNING")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except ValueError as exc:
        print(f"kvstrata: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
