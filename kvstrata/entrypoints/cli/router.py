"""`kvstrata router`: route OpenAI requests over several `kvstrata serve` engines (kvstrata.router)."""

from __future__ import annotations

from kvstrata.router.policies import POLICIES
from kvstrata.router.proxy import RouterConfig, build_fleet, create_router_app, load_tokenizer


def add_router(commands) -> None:
    parser = commands.add_parser("router", help="route OpenAI requests over several `kvstrata serve` engines")
    parser.add_argument("--engine", action="append", required=True, metavar="URL",
                        help="an engine's base URL (http://host:port); repeat for each engine")
    parser.add_argument("--policy", default="kv_aware", choices=list(POLICIES),
                        help="routing policy, as `kvstrata simulate --router` (default: kv_aware)")
    parser.add_argument("--model", default=None,
                        help="the engines' model, for its tokenizer and chat template (default: the embedded one)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="longest wait in seconds for an engine's next bytes")
    parser.add_argument("--engine-api-key", default=None,
                        help="the engines' --api-key, for the router's KV-event polls (clients' keys are passed on)")
    parser.set_defaults(run=run_router, default_log_level="INFO")


def run_router(args) -> int:
    import uvicorn

    from kvstrata.entrypoints.cli.serve import ready_server

    config = RouterConfig(tuple(url.rstrip("/") for url in args.engine), args.policy, args.health_interval,
                          request_timeout=args.request_timeout, engine_api_key=args.engine_api_key).validate()
    fleet = build_fleet(config, load_tokenizer(args.model))
    server = uvicorn.Config(create_router_app(fleet), host=args.host, port=args.port,
                            log_level=args.log_level.lower(), access_log=False)
    ready_server(server, f"routing ({config.policy}) over {len(config.engines)} engines on "
                         f"http://{args.host}:{args.port} (OpenAI API under /v1)").run()
    return 0
