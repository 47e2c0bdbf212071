"""`kvstrata router`: route OpenAI requests over several `kvstrata serve` engines (kvstrata.router)."""

from __future__ import annotations

from kvstrata.core.front_door import DoorRules
from kvstrata.router.fleet import RouterConfig, build_fleet, load_tokenizer
from kvstrata.router.policies import POLICIES
from kvstrata.router.proxy import create_router_app


def add_router(commands) -> None:
    parser = commands.add_parser("router", help="route OpenAI requests over several `kvstrata serve` engines")
    parser.add_argument("--engine", action="append", default=[], metavar="URL",
                        help="an engine's base URL (http://host:port); repeat for each engine")
    parser.add_argument("--policy", default="kv_aware", choices=list(POLICIES),
                        help="routing policy, as `kvstrata simulate --router`; with --pd-disaggregation, over "
                             "the prefill engines (default: kv_aware)")
    parser.add_argument("--pd-disaggregation", action="store_true",
                        help="prefill/decode disaggregation: each request to a --prefill engine, then to a "
                             "--decode engine that loads the prompt's KV from the store they share")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="with --pd-disaggregation: an engine run with --disaggregation-mode prefill; repeat")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="with --pd-disaggregation: an engine run with --disaggregation-mode decode; repeat "
                             "(chosen least loaded, with a conversation's earlier turns: prefix_affinity)")
    parser.add_argument("--handoff-timeout", type=float, default=120.0,
                        help="with --pd-disaggregation: longest wait in seconds for a prefill engine's answer "
                             "(its prefill and store writes); past it the request is served colocated")
    parser.add_argument("--local-prefill-tokens", type=int, default=0,
                        help="with --pd-disaggregation: a prompt with at most this many tokens its decode engine "
                             "does not hold (a short prompt, a conversation's next turn) is prefilled there, not "
                             "handed over: its prefill stalls that engine's streams for less than a handoff delays "
                             "its first token (Dynamo's conditional disaggregation; default 0: every prompt "
                             "handed over)")
    parser.add_argument("--model", default=None,
                        help="the engines' model, for its tokenizer and chat template (default: the embedded one)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="longest wait in seconds for an engine's next bytes")
    parser.add_argument("--engine-api-key", default=None,
                        help="the engines' --api-key, for the router's KV-event polls; with --api-key, for every "
                             "call to an engine (else clients' keys are passed on)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health, checked before a body "
                             "is read (default: open)")
    parser.add_argument("--metrics-without-key", action="store_true",
                        help="with --api-key, leave /metrics open (for a Prometheus that cannot send the key)")
    parser.add_argument("--max-body-bytes", type=int, default=8 << 20,
                        help="largest request body in bytes; a larger one gets 413 before it is read")
    parser.add_argument("--body-timeout", type=float, default=60.0,
                        help="seconds a client has to send its whole request body (408 past it, or after 10 s with "
                             "no byte)")
    parser.set_defaults(run=run_router, default_log_level="INFO")


def run_router(args) -> int:
    import uvicorn

    from kvstrata.entrypoints.cli.serve import ready_server

    if args.pd_disaggregation != bool(args.prefill or args.decode):
        raise ValueError("--prefill and --decode engines go with --pd-disaggregation (and it needs both)")

    def urls(given: list[str]) -> tuple[str, ...]:
        return tuple(url.rstrip("/") for url in given)

    config = RouterConfig(urls(args.engine), args.policy, args.health_interval, request_timeout=args.request_timeout,
                          engine_api_key=args.engine_api_key, api_key=args.api_key, prefill=urls(args.prefill), decode=urls(args.decode),
                          handoff_timeout=args.handoff_timeout,
                          local_prefill_tokens=args.local_prefill_tokens).validate()
    fleet = build_fleet(config, load_tokenizer(args.model))
    if args.max_body_bytes < 1024 or args.body_timeout <= 0:
        raise ValueError("--max-body-bytes must be at least 1024 and --body-timeout positive")
    door = DoorRules.of(args.api_key, args.metrics_without_key, args.max_body_bytes, args.body_timeout)
    server = uvicorn.Config(create_router_app(fleet, door), host=args.host, port=args.port,
                            log_level=args.log_level.lower(), access_log=False)
    shape = (f"{len(config.prefill)} prefill + {len(config.decode)} decode engines" if config.disaggregated
             else f"{len(config.engines)} engines")
    ready_server(server, f"routing ({config.policy}) over {shape} on "
                         f"http://{args.host}:{args.port} (OpenAI API under /v1)").run()
    return 0
