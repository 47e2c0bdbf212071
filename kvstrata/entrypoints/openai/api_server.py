"""The OpenAI-compatible HTTP app over a started `AsyncLLMEngine`: error handling, the API key,
CORS, and the endpoints of kvstrata.entrypoints.openai.routes.

Every error is an OpenAI-format body with the right status; nothing a client sends can crash the
server or leave a block held. The app reads the engine only through what its thread publishes.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence, Sized
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvstrata import __version__
from kvstrata.engine.async_engine import AsyncLLMEngine
from kvstrata.entrypoints.openai.errors import ApiError, error_response, validation_message
from kvstrata.entrypoints.openai.metrics import BoundedStores, ServerMetrics
from kvstrata.entrypoints.openai.adapter_routes import adapter_router
from kvstrata.entrypoints.openai.responses.routes import responses_router
from kvstrata.entrypoints.openai.routes import router
from kvstrata.entrypoints.openai.state import ServerState
from kvstrata.entrypoints.openai.timelines import TIMELINES_KEPT, TimelineStore
from kvstrata.entrypoints.openai.tracker import request_log

if TYPE_CHECKING:
    from kvstrata.entrypoints.openai.tracing import RequestTracing

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def create_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None, max_queue: int = 256,
               allowed_origins: Sequence[str] = (), tracing: RequestTracing | None = None,
               disaggregation_mode: str = "both", timelines_kept: int = TIMELINES_KEPT) -> FastAPI:
    """The HTTP API over a started AsyncLLMEngine. `allowed_origins`: CORS (none: no CORS headers);
    `tracing`: where each finished request's trace goes (None: no tracing; the caller shuts it down);
    `disaggregation_mode`: the prefill/decode handoffs it takes (kvstrata.entrypoints.openai.handoff);
    `timelines_kept`: how many finished requests' timelines `GET /v1/timelines` can still return."""
    assert engine.info is not None and engine.prompts is not None, "start() the engine before serving it"
    info = engine.info
    app = FastAPI(title="kvstrata", version=__version__)
    metrics = ServerMetrics(lambda: engine.snapshot, info.max_model_len, model_name)
    state = ServerState(engine, model_name, info.max_model_len, info.vocab_size, api_key, max_queue, metrics,
                        engine.prompts, TimelineStore(timelines_kept), tracing, disaggregation_mode)
    app.state.kvstrata = state
    bounded: dict[str, Sized] = {"timelines": state.timelines}
    if engine.kv_events is not None:
        bounded["kv_events"] = engine.kv_events
    metrics.registry.register(BoundedStores(bounded))
    _handle_errors(app, state)

    if api_key:
        app.add_middleware(_ApiKey, state=state)
    if allowed_origins:      # outermost, so a browser's preflight is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.include_router(router)
    if info.runtime_lora_updating:      # else no such routes, as in vLLM: 404 whatever the body
        app.include_router(adapter_router)
    app.include_router(responses_router())
    return app


class _ApiKey:
    """Refuses /v1/* without 'Authorization: Bearer KEY'. Plain ASGI, not `@app.middleware`: Starlette's
    BaseHTTPMiddleware keeps a client's disconnect from the handlers' `request.is_disconnected()`, and
    a handler must see it to abort a request still waiting for its first token."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app, self.state = app, state
        self.expected = f"Bearer {state.api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = _refused(self.state, Request(scope), 401, "missing or wrong API key (send "
                                    "'Authorization: Bearer KEY')", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _refused(state: ServerState, request: Request, status: int, message: str, param: str | None = None,
             code: str | None = None):
    """Every error a generation request gets counts as outcome="rejected", with one log line."""
    if request.url.path in GENERATION_PATHS:
        state.metrics.rejected()
        request_log.info("%s rejected (%d, param %s): %s", request.url.path, status, param, message)
    return error_response(status, message, param, code)


def _handle_errors(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _refused(state, request, exc.status, exc.message, exc.param, exc.code)

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
