"""`kvstrata router`: one OpenAI-compatible endpoint over many `kvstrata serve` engines.

    client -> router: tokenize as the engines do (tokenizer, chat template), hash the blocks with the
              engines' chain root (it carries the cache salt), ask the policy (kvstrata.router.policies)
           -> engine: the request body, unchanged; the reply (or the stream) is relayed unchanged

Per engine, a watcher long-polls `/v1/kv_events` into an `EventView` (kvstrata.router.event_view) and
checks `/health` (kvstrata.router.fleet). An engine that does not answer, answers 503 or fails its
health check is taken out: it gets no new requests, and the request that found it out is sent to
another engine (a stream that already started ends with an error event instead: its tokens cannot
be taken back; kvstrata.router.forwarding). It comes back at its next good health check, with a
snapshot of what it holds. With --pd-disaggregation, a request goes to a prefill engine and then to
a decode engine (kvstrata.router.disaggregated).

`/v1/timelines` gathers the engines' timelines of the named requests, each marked with its engine.
/metrics counts requests routed per engine and outcome, prompt tokens routed and the tokens the
policy predicted its caches would cover, and the handoffs of a disaggregated fleet.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstrata.core.disconnects import ClientGone
from kvstrata.core.front_door import DoorRules, FrontDoor
from kvstrata.router.disaggregated import route_pd
from kvstrata.router.fleet import Fleet
from kvstrata.router.forwarding import CLIENT_GONE, error, forward, read_body


def create_router_app(fleet: Fleet, door: DoorRules | None = None) -> FastAPI:
    """The router's HTTP app; `door`: its key and body limits (kvstrata.core.front_door), checked
    before a body is read (default: no key, the default limits)."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        fleet.start()
        yield
        await fleet.stop()

    app = FastAPI(title="kvstrata router", lifespan=lifespan)
    app.add_middleware(FrontDoor, rules=door or DoorRules(fleet.config.api_key))
    app.state.fleet = fleet
    route = route_pd if fleet.config.disaggregated else _route

    @app.get("/health")
    async def health():
        engines = {view.url: view.available for view in fleet.views}
        status = 200 if any(engines.values()) else 503
        return JSONResponse({"status": "ok" if status == 200 else "no engine available", "engines": engines},
                            status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(fleet.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        return await _forward_get(fleet, request, "/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        return await _forward_get(fleet, request, f"/v1/models/{model_id}")

    @app.get("/v1/timelines")
    async def timelines(request: Request):
        return await _gather_timelines(fleet, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await route(fleet, request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(fleet, request, "/v1/completions")

    return app


async def _forward_get(fleet: Fleet, request: Request, path: str) -> Response:
    for view in [v for v in fleet.views if v.available]:
        try:
            reply = await fleet.client.get(f"{view.url}{path}", headers=fleet.headers_for_engine(request.headers))
        except httpx.TransportError as exc:
            fleet.take_out(view, f"{type(exc).__name__}: {exc}")
            continue
        return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))
    return error(503, "no engine is available", "no_engine_available")


async def _gather_timelines(fleet: Fleet, request: Request) -> dict:
    """`GET /v1/timelines?id=..` of every engine, merged, each timeline marked with its engine's URL: where a
    request's time went and on which engine (`kvstrata bench` through a router). A disaggregated request
    has one on each side; the decode engine's, the side whose response id the client saw, is the one kept
    (decode engines come after prefill engines in the fleet). Engines that do not answer are left out."""
    params = list(request.query_params.multi_items())

    async def ask(view) -> dict:
        try:
            reply = await fleet.client.get(f"{view.url}/v1/timelines", params=params,
                                            headers=fleet.headers_for_engine(request.headers))
            return reply.json()["timelines"] if reply.status_code == 200 else {}
        except (httpx.HTTPError, ValueError, KeyError):
            return {}

    found: dict[str, dict] = {}
    for view, kept in zip(fleet.views, await asyncio.gather(*(ask(view) for view in fleet.views))):
        found.update({rid: {**timeline, "engine": view.url} for rid, timeline in kept.items()})
    return {"timelines": found}


async def _route(fleet: Fleet, request: Request, path: str) -> Response:
    """Colocated: the whole request to the policy's engine (or, if that one is down, the next choice)."""
    raw, body = await read_body(request)
    try:
        return await forward(fleet, request, path, raw, await fleet.routed_prompt(path, body), fleet.colocated)
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
