"""The OpenAI-compatible HTTP app over a started `AsyncLLMEngine`: error handling, the front door
(kvstrata.core.front_door: the API key, body limits), CORS, and the endpoints of
kvstrata.entrypoints.openai.routes.

Every error is an OpenAI-format body with the right status; nothing a client sends can crash the
server or leave a block held. The app reads the engine only through what its thread publishes.
"""

from __future__ import annotations

import logging
from collections.abc import Sized
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstrata import __version__
from kvstrata.core.config import ServerConfig
from kvstrata.core.front_door import DoorRules, FrontDoor
from kvstrata.engine.async_engine import AsyncLLMEngine
from kvstrata.entrypoints.openai.adapter_routes import adapter_router
from kvstrata.entrypoints.openai.errors import ApiError, error_response, validation_message
from kvstrata.entrypoints.openai.intake import Intake
from kvstrata.entrypoints.openai.metrics import BoundedStores, ServerMetrics
from kvstrata.entrypoints.openai.responses.routes import responses_router
from kvstrata.entrypoints.openai.routes import router
from kvstrata.entrypoints.openai.state import ServerState
from kvstrata.entrypoints.openai.timelines import TimelineStore
from kvstrata.entrypoints.openai.tracker import request_log

if TYPE_CHECKING:
    from kvstrata.entrypoints.openai.tracing import RequestTracing

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def create_app(engine: AsyncLLMEngine, model_name: str, server: ServerConfig | None = None,
               tracing: RequestTracing | None = None) -> FastAPI:
    """The HTTP API over a started AsyncLLMEngine, with `server`'s key, limits, CORS origins, queue and
    handoff mode; `tracing`: where each finished request's trace goes (None: no tracing; the caller
    shuts it down)."""
    assert engine.info is not None and engine.prompts is not None, "start() the engine before serving it"
    server = server or ServerConfig()
    info = engine.info
    app = FastAPI(title="kvstrata", version=__version__)
    metrics = ServerMetrics(lambda: engine.snapshot, info.max_model_len, model_name)
    state = ServerState(engine, model_name, info.max_model_len, info.vocab_size, server.max_queue, metrics,
                        engine.prompts, Intake(engine.prompts, info.max_model_len),
                        TimelineStore(server.timelines_kept), tracing, server.disaggregation_mode)
    app.state.kvstrata = state
    bounded: dict[str, Sized] = {"timelines": state.timelines}
    if engine.kv_events is not None:
        bounded["kv_events"] = engine.kv_events
    metrics.registry.register(BoundedStores(bounded))
    _handle_errors(app, state)

    rules = DoorRules.of(server.api_key, server.metrics_without_key, server.max_body_bytes, server.body_timeout)
    app.add_middleware(FrontDoor, rules=rules,
                       refused=lambda path, status, message: _counted(state, path, status, message))
    if server.origins:      # outermost, so a browser's preflight is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(server.origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.include_router(router)
    if info.runtime_lora_updating:      # else no such routes, as in vLLM: 404 whatever the body
        app.include_router(adapter_router)
    app.include_router(responses_router())
    return app


def _counted(state: ServerState, path: str, status: int, message: str, param: str | None = None) -> None:
    """Every error a generation request gets counts as outcome="rejected", with one log line."""
    if path in GENERATION_PATHS:
        state.metrics.rejected()
        request_log.info("%s rejected (%d, param %s): %s", path, status, param, message)


def _refused(state: ServerState, request: Request, status: int, message: str, param: str | None = None,
             code: str | None = None, headers: dict[str, str] | None = None):
    _counted(state, request.url.path, status, message, param)
    return error_response(status, message, param, code, headers)


def _handle_errors(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _refused(state, request, exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return _refused(state, request, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        logger.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}")
