"""OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models[/{id}], /health,
/metrics, and vLLM's /tokenize, /detokenize and /version; /v1/kv_events for routers.

Every error is an OpenAI-format body `{"error": {"message", "type", "param", "code"}}` with the
right status; nothing a client sends can crash the server or leave a block held. Parameters the
OpenAI API defines but kvstrata does not implement are refused with 400, never silently ignored
(see UNSUPPORTED); unknown fields are refused too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstrata import __version__
from kvstrata.core.outputs import RequestOutput, TokenLogprob, best_samples
from kvstrata.core.sampling_params import MAX_SAMPLES, GrammarSpec, SamplingParams
from kvstrata.engine.kv_events import publish
from kvstrata.engine.llm_engine import AsyncLLMEngine, ChatPrompt, Prompt
from kvstrata.entrypoints.openai.metrics import ServerMetrics
from kvstrata.structured.grammar import compile_grammar, spec_from_request
from kvstrata.structured.tool_calls import ToolCallStream, ToolPlan, message

logger = logging.getLogger(__name__)

MAX_STOP = 16
COMPLETION_MAX_TOKENS = 16      # /v1/completions without max_tokens, as OpenAI and vLLM
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")

# Defined by the OpenAI API, not implemented here: a request that sets one to a non-default value gets 400.
UNSUPPORTED = {
    "echo": False, "suffix": None, "logit_bias": None,
    "functions": None, "function_call": None, "audio": None, "modalities": None, "prediction": None,
    "web_search_options": None, "reasoning_effort": None, "service_tier": None, "store": None,
    "metadata": None,
}


# ---- request bodies -----------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingBody(BaseModel):
    """Fields shared by chat and completions (OpenAI names, plus vLLM's extensions)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)               # extension (vLLM); 0 = off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # extension
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)  # extension
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None           # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                          # extension
    min_tokens: int = Field(default=0, ge=0)          # extension
    priority: int = 0                                 # extension: lower is served first (policy=priority)
    response_format: dict[str, Any] | None = None     # text, json_object, json_schema (structured.py)
    structured_outputs: dict[str, Any] | None = None  # extension (vLLM): json, regex, choice, grammar, json_object
    guided_json: dict[str, Any] | str | None = None   # extension (vLLM before 0.12), as the four below
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None                           # accepted; kvstrata keeps no per-user state
    n: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)          # None: 1
    best_of: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)    # sampled; the n best return
    # Defined by OpenAI, refused unless default (see UNSUPPORTED).
    echo: bool | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop must be at most {MAX_STOP} non-empty strings")
        return value

    def refuse_unsupported(self) -> None:
        for name, default in UNSUPPORTED.items():
            value = getattr(self, name, default)
            if value is None or value == default:
                continue
            raise ApiError(400, f"'{name}' is not supported by kvstrata", param=name)

    def structured(self) -> GrammarSpec | None:
        """The grammar the output must match, from whichever field asked for one."""
        guided = {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                         "guided_grammar")}
        return spec_from_request(self.response_format, self.structured_outputs, guided)

    def sampling(self, max_tokens: int | None, logprobs: int | None,
                 structured: GrammarSpec | None = None) -> SamplingParams:
        """max_tokens None: up to the context length, resolved once the prompt is tokenized. The grammar
        is compiled here, off the engine thread (the engine finds it cached)."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=tuple(stops),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, logprobs=logprobs,
            n=self.n or 1, best_of=self.best_of, structured=structured,
        ).validate()
        if structured is not None:
            compile_grammar(structured)
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None      # None only for assistant (as OpenAI allows)
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None         # assistant: the calls it made (tool_calls.py)
    tool_call_id: str | None = None                        # tool: the call this is the result of

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_calls is not None and (self.role != "assistant" or not all(
                isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments"), str) for c in self.tool_calls)):
            raise ValueError('tool_calls belong to assistant messages, each {"id", "type": "function", '
                             '"function": {"name", "arguments"}}')
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt (encoded as /v1/completions encodes it) or chat messages."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


# ---- errors -------------------------------------------------------------------------------------
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_error", 503: "overloaded_error"}


STEP_FAILED = ("the engine step computing this request failed; the request was ended and everything it held "
               "was released (the server goes on serving): retry it")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param): `param` is the top-level field the user sent (`messages`), never pydantic's
    path; the message points inside it (`messages[1].content`), without pydantic's type tags."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = str(loc[0]) if loc else None
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
        else:
            break                    # a union member's tag (str, list[...], function-after[...]): stop
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        return f"unknown parameter '{path}'", param
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{path or 'body'}: {message}", param


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "any"}


# ---- the app ------------------------------------------------------------------------------------
@dataclass
class ServerState:
    engine: AsyncLLMEngine
    model_name: str
    max_model_len: int
    api_key: str | None
    max_queue: int
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None, max_queue: int = 256,
               allowed_origins: Sequence[str] = ()) -> FastAPI:
    """The HTTP API over a started AsyncLLMEngine. `allowed_origins`: CORS (none: no CORS headers)."""
    app = FastAPI(title="kvstrata", version=__version__)
    state = ServerState(engine, model_name, engine.engine.config.scheduler.max_model_len, api_key, max_queue,
                        ServerMetrics(engine.engine, model_name))
    app.state.kvstrata = state

    def refused(request: Request, status: int, message: str, param: str | None = None, code: str | None = None):
        """Every error a generation request gets counts as outcome="rejected", with one log line."""
        if request.url.path in GENERATION_PATHS:
            state.metrics.rejected()
            logger.info("%s rejected (%d, param %s): %s", request.url.path, status, param, message)
        return error_response(status, message, param, code)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return refused(request, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return refused(request, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        logger.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if state.api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                return refused(request, 401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key")
        return await call_next(request)

    if allowed_origins:      # outermost, so a browser's preflight is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return error_response(503, f"engine failed: {engine.error!r}")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    events = publish(engine.engine.scheduler, engine.engine.hasher.root)

    @app.get("/v1/kv_events")
    async def kv_events(since: int = 0, instance: str | None = None, timeout: float = Query(0.0, ge=0.0, le=30.0)):
        """What the caches hold, for routers (kvstrata.engine.kv_events): long-polls up to `timeout` seconds."""
        return await events.poll(since, instance, timeout)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def card() -> dict:
        return {"id": model_name, "object": "model", "created": state.created, "owned_by": "kvstrata",
                "root": model_name, "parent": None, "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise ApiError(404, f"the model '{model_id}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return card()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(state, body.model)
        tokenizer = engine.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send either 'prompt' or 'messages'", param="prompt")
        try:
            if body.messages is not None:
                ids = engine.engine.chat_prompt(_chat_messages(body.messages))
            else:
                ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages" if body.messages is not None else "prompt") from exc
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(state, body.model)
        vocab = engine.engine.loaded.arch.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": engine.engine.tokenizer.decode(body.tokens)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_common(state, body)
        messages = _chat_messages(body.messages)
        try:
            tools = ToolPlan.from_request(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from exc
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        prompt = ChatPrompt(tuple(messages), tuple(tools.prompt_tools) if tools else ())
        return await _respond(state, request, body, prompt, max_tokens, logprobs, chat=True, tools=tools)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_common(state, body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "batched prompts are not supported: send one request per prompt", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        return await _respond(state, request, body, prompt, max_tokens, body.logprobs, chat=False)

    return app


def _chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            item["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


def _check_common(state: ServerState, body: _SamplingBody) -> None:
    _check_model(state, body.model)
    body.refuse_unsupported()
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if body.stream and (body.best_of or 1) > (body.n or 1):
        raise ApiError(400, "best_of greater than n cannot be streamed (the best are known at the end)",
                       param="best_of")
    if state.engine.num_unfinished >= state.max_queue:
        raise ApiError(503, f"the server is at capacity ({state.max_queue} requests in flight); retry later",
                       code="server_overloaded")


async def _respond(state: ServerState, request: Request, body: _SamplingBody, prompt: Prompt,
                   max_tokens: int | None, logprobs: int | None, chat: bool, tools: ToolPlan | None = None):
    kind = "chat.completion" if chat else "text_completion"
    try:
        params = body.sampling(max_tokens, logprobs, _constraint(body, tools))
    except ValueError as exc:        # a schema the grammar library rejects too: nothing is queued
        param = getattr(exc, "param", None) or ("best_of" if "best_of" in str(exc) else None)
        raise ApiError(400, str(exc), param=param) from exc
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    tracker = _Tracker(state, time.monotonic(), request_id, params.num_samples)
    stream = state.engine.generate(prompt, params, request_id, body.priority)
    try:
        first = await anext(stream)
    except ValueError as exc:        # refused by the engine (too long, bad template input): nothing queued
        param = getattr(exc, "param", "prompt")
        if param == "max_tokens" and chat and body.max_completion_tokens is not None:
            param = "max_completion_tokens"
        elif param == "prompt" and chat:
            param = "messages"
        raise ApiError(400, str(exc), param=param) from exc
    tracker.seen(first)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return StreamingResponse(_sse(state, tracker, first, stream, request_id, chat, include_usage, params.n,
                                      tools),
                                 media_type="text/event-stream")
    outputs = [first]
    try:
        if not tracker.finished:
            async for out in _until_disconnected(request, stream):
                tracker.seen(out)
                outputs.append(out)
    finally:
        tracker.done()
    if any(out.finish_reason == "error" for out in outputs):
        raise ApiError(500, STEP_FAILED, code="engine_step_failed")
    samples = [[out for out in outputs if out.index == index] for index in range(params.num_samples)]
    samples = [outputs for outputs in samples if outputs]         # all, unless the client left early
    return _full_response(state, samples, params.n, request_id, kind, chat, tracker.arrival_wall, tools)


def _constraint(body: _SamplingBody, tools: ToolPlan | None) -> GrammarSpec | None:
    """The request's grammar: from response_format or vLLM's fields, or from a required/named tool_choice."""
    asked = body.structured()
    forced = tools.constraint() if tools is not None else None
    if asked is not None and forced is not None:
        raise ApiError(400, f"tool_choice {tools.mode} constrains the reply already; drop {asked.param}",
                       param=asked.param)
    return asked or forced


class _Tracker:
    """Latency bookkeeping for one request (all its samples), reported to metrics and logged (one
    INFO line) when it ends, however it ends."""

    def __init__(self, state: ServerState, arrival: float, request_id: str, num_samples: int = 1):
        self.state, self.arrival, self.request_id = state, arrival, request_id
        self.arrival_wall = int(time.time())
        self.first: float | None = None
        self.last: RequestOutput | None = None
        self.latest: dict[int, RequestOutput] = {}       # each sample's latest output
        self.num_samples = num_samples

    def seen(self, out: RequestOutput) -> None:
        if out.new_token_ids and self.first is None:
            self.first = time.monotonic()
        self.last = self.latest[out.index] = out

    @property
    def finished(self) -> bool:
        return len(self.latest) == self.num_samples and all(out.finished for out in self.latest.values())

    def done(self) -> None:
        last, end = self.last, time.monotonic()
        outcome = (last.finish_reason or "abort") if last and self.finished else "abort"
        num_output = sum(out.num_output_tokens for out in self.latest.values())
        self.state.metrics.observe(outcome, self.arrival, self.first, end, num_output,
                                   last.num_prompt_tokens if last else None,
                                   last.first_scheduled_time if last else None)
        ttft = f"{self.first - self.arrival:.3f}s" if self.first is not None else "-"
        logger.info("%s: %d prompt tokens (%d cached), %d output tokens, ttft %s, %.3fs, finish %s",
                    self.request_id, last.num_prompt_tokens if last else 0, last.num_cached_tokens if last else 0,
                    num_output, ttft, end - self.arrival, outcome)


async def _until_disconnected(request: Request, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Iterate `stream`, but stop (and so abort the request) if the client goes away meanwhile."""
    iterator = stream.__aiter__()
    while True:
        step = asyncio.ensure_future(anext(iterator))
        while not step.done():
            done, _ = await asyncio.wait({step}, timeout=0.5)
            if not done and await request.is_disconnected():
                step.cancel()
                await iterator.aclose()
                return
        try:
            yield step.result()
        except StopAsyncIteration:
            return


def _usage(finals: Sequence[RequestOutput]) -> dict:
    """The prompt once (its samples share it), the completion tokens of every returned sample."""
    first, completion = finals[0], sum(out.num_output_tokens for out in finals)
    return {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens}}


def _token_text(state: ServerState, token_id: int) -> str:
    return state.engine.engine.tokenizer.decode([token_id])


def _chat_logprobs(state: ServerState, entries: list[TokenLogprob]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(state, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def _completion_logprobs(state: ServerState, entries: list[TokenLogprob], offset: int) -> dict:
    tokens = [_token_text(state, e.token_id) for e in entries]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_token_text(state, t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def _full_response(state: ServerState, samples: list[list[RequestOutput]], n: int, request_id: str, kind: str,
                   chat: bool, created: int, tools: ToolPlan | None = None) -> dict:
    """One choice per returned sample: each sample's outputs joined, the n best kept (best_of); with
    tools, each choice's reply parsed for tool calls."""
    finals = best_samples([_joined(outputs) for outputs in samples], n)
    choices = []
    for final in finals:
        choice: dict[str, Any] = {"index": final.index, "finish_reason": final.finish_reason if final.finished
                                  else "abort"}
        if chat:
            choice["message"] = {"role": "assistant", "content": final.text}
            if tools is not None:
                choice["message"], choice["finish_reason"] = message(tools, final.text, choice["finish_reason"])
            choice["logprobs"] = _chat_logprobs(state, final.logprobs) if final.logprobs else None
        else:
            choice["text"] = final.text
            choice["logprobs"] = _completion_logprobs(state, final.logprobs, 0) if final.logprobs else None
        choices.append(choice)
    return {"id": request_id, "object": kind, "created": created, "model": state.model_name,
            "choices": choices, "usage": _usage(finals)}


def _joined(outputs: list[RequestOutput]) -> RequestOutput:
    """One sample's outputs as one: its whole text and logprobs, its last state."""
    return dataclasses.replace(outputs[-1], text="".join(o.text for o in outputs),
                               logprobs=[lp for o in outputs for lp in o.logprobs])


async def _sse(state: ServerState, tracker: _Tracker, first: RequestOutput, stream: AsyncIterator[RequestOutput],
               request_id: str, chat: bool, include_usage: bool, n: int = 1, tools: ToolPlan | None = None
               ) -> AsyncIterator[str]:
    """Server-sent events, each choice with its sample's `index` (and, with tools, its own tool-call
    parser); the client going away cancels this generator, which aborts the request."""
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"
    created = tracker.arrival_wall
    offsets = [0] * n
    calls = [ToolCallStream(tools) for _ in range(n)] if tools is not None else None

    def event(choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": request_id, "object": chunk_kind, "created": created, "model": state.model_name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def choice(out: RequestOutput) -> dict:
        finish = out.finish_reason if out.finished else None
        if chat:
            delta = {"content": out.text} if out.text else {}
            if calls is not None:
                delta, finish = calls[out.index].delta(out.text, finish)
            item = {"index": out.index, "delta": delta, "finish_reason": finish,
                    "logprobs": _chat_logprobs(state, out.logprobs) if out.logprobs else None}
        else:
            item = {"index": out.index, "text": out.text, "finish_reason": finish, "logprobs":
                    _completion_logprobs(state, out.logprobs, offsets[out.index]) if out.logprobs else None}
        offsets[out.index] += len(out.text)
        return item

    try:
        if chat:
            yield event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for index in range(n)])
        yield event([choice(first)])
        if not tracker.finished:
            async for out in stream:
                tracker.seen(out)
                yield event([choice(out)])
        if any(out.finish_reason == "error" for out in tracker.latest.values()):   # the openai client raises
            error = {"message": STEP_FAILED, "type": ERROR_TYPES[500], "param": None, "code": "engine_step_failed"}
            yield f"data: {json.dumps({'error': error})}\n\n"
        if include_usage:
            yield event([], _usage([tracker.latest[index] for index in sorted(tracker.latest)]))
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()
        tracker.done()
