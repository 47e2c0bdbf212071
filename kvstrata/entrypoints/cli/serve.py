"""`kvstrata serve`: the OpenAI-compatible server over one engine, and the uvicorn server both
`serve` and `router` run."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import signal
import time

from kvstrata.core.config import EngineConfig, ServerConfig
from kvstrata.entrypoints.cli.allocator import run_on_jemalloc
from kvstrata.entrypoints.flags import add_engine_flags, add_section_flags, engine_config


def add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model, as --model (vllm serve MODEL)")
    add_section_flags(parser, "server", ServerConfig)
    add_engine_flags(parser)
    parser.set_defaults(run=run_serve, default_log_level="INFO")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvstrata.engine.async_engine import AsyncLLMEngine
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.entrypoints.openai.api_server import create_app
    from kvstrata.kvcache.faults import ENV_VAR, FaultInjector
    from kvstrata.model.loader import describe_runs

    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise ValueError(f"two models given: {args.model_arg} and --model {args.model}")
        args.model = args.model_arg
    server = ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)}).validate()
    if getattr(args, "argv", None) is not None:
        run_on_jemalloc(server.allocator, args.argv)     # returns only where the process stays on glibc
    started = time.monotonic()
    tracing = None
    if server.otlp_traces_endpoint is not None:     # before loading, so a missing package fails at once
        from kvstrata.entrypoints.openai.tracing import RequestTracing
        tracing = RequestTracing.otlp(server.otlp_traces_endpoint)
    faults = FaultInjector.from_env()
    if faults is not None:
        logging.getLogger("kvstrata").warning("%s is set: injecting faults %s", ENV_VAR, faults.every)
    engine_settings = disaggregated(engine_config(args), server.disaggregation_mode)
    # Loaded on the engine thread, so one OpenMP team runs every step (see AsyncLLMEngine).
    async_engine = AsyncLLMEngine(lambda: LLMEngine(engine_settings, faults=faults),
                                   kv_events_kept=server.kv_events_kept).start()
    name = server.served_model_name or async_engine.info.model_name
    app = create_app(async_engine, name, server, tracing)
    # What loading made (~300k objects: the model, tokenizer, compiled graphs) lives until exit, and a
    # full collection walked it in ~215 ms, a stall of every running stream; frozen, it takes 0.0 ms
    # (2-core EPYC, docs/design/scheduler.md). vLLM and SGLang freeze after start-up for the same reason.
    gc.collect()
    gc.freeze()
    # uvicorn stops accepting on SIGTERM/SIGINT, lets open requests run for shutdown_timeout seconds,
    # then cancels them (which aborts their requests); what is left is aborted below. Once done it
    # re-raises the signal into the handlers it found: these, so the process goes on to exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=server.shutdown_timeout, access_log=False)
    ready_server(config, f"serving {name} on http://{server.host}:{server.port} (OpenAI API under /v1), "
                        f"ready {time.monotonic() - started:.1f}s after loading began: "
                        f"{describe_runs(async_engine.info.runs)}").run()
    log = logging.getLogger("kvstrata")
    log.info("shutting down: %d requests in flight", async_engine.num_unfinished)
    async_engine.shutdown()
    if tracing is not None:
        tracing.shutdown()      # sends what is queued, giving a collector that is down 5 s at most
    final = async_engine.snapshot
    stats = final.cache
    log.info("stopped: %d steps, %d prompt tokens (%d from cache), %d tokens generated; %d blocks written to "
             "the store, %d not", final.engine.steps, stats.prompt_tokens, sum(stats.hit_tokens.values()),
             final.engine.generated_tokens, stats.offloaded_blocks["store"], final.num_unpersisted)
    return 0


def disaggregated(config: EngineConfig, mode: str) -> EngineConfig:
    """The engine settings a --disaggregation-mode needs: a store shared with the other role and
    prefix caching; a prefill engine writes blocks through to the store as soon as they are full, so
    a long prompt's writes overlap its later chunks instead of all waiting at its end."""
    if mode == "both":
        return config
    if config.cache.store == "none" or not config.cache.enable_prefix_caching:
        raise ValueError(f"--disaggregation-mode {mode} hands KV over through a store shared with the other role: "
                         "give --store (redis://... for engines on several machines) and keep prefix caching on")
    if mode == "prefill" and config.cache.write_policy != "write_through":
        logging.getLogger("kvstrata").info("--disaggregation-mode prefill: --write-policy write_through")
        return dataclasses.replace(config, cache=dataclasses.replace(config.cache, write_policy="write_through"))
    return config


def ready_server(config, ready_line: str):
    """A uvicorn server that logs `ready_line` once its socket accepts connections, not before."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                logging.getLogger("kvstrata").warning("%s", ready_line)

    return _Server(config)
