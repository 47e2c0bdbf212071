"""Serving a completion: the checks common to chat and completions, the request sent to the engine,
and its outputs gathered into one response or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvstrata.core.outputs import RequestOutput
from kvstrata.core.sampling_params import GrammarSpec
from kvstrata.engine.prompts import Prompt
from kvstrata.entrypoints.openai.errors import STEP_FAILED, ApiError
from kvstrata.entrypoints.openai.protocol import SamplingBody
from kvstrata.entrypoints.openai.completion_output import full_response, sse
from kvstrata.entrypoints.openai.state import ServerState
from kvstrata.entrypoints.openai.tracker import RequestTracker
from kvstrata.structured.tool_calls import ToolPlan


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


def check_common(state: ServerState, body: SamplingBody) -> None:
    check_model(state, body.model)
    body.refuse_unsupported()
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if body.stream and (body.best_of or 1) > (body.n or 1):
        raise ApiError(400, "best_of greater than n cannot be streamed (the best are known at the end)",
                       param="best_of")
    if state.engine.num_unfinished >= state.max_queue:
        raise ApiError(503, f"the server is at capacity ({state.max_queue} requests in flight); retry later",
                       code="server_overloaded")


async def respond(state: ServerState, request: Request, body: SamplingBody, prompt: Prompt,
                   max_tokens: int | None, logprobs: int | None, chat: bool, tools: ToolPlan | None = None):
    kind = "chat.completion" if chat else "text_completion"
    try:
        params = body.sampling(max_tokens, logprobs, _constraint(body, tools))
    except ValueError as exc:        # a schema the grammar library rejects too: nothing is queued
        param = getattr(exc, "param", None) or ("best_of" if "best_of" in str(exc) else None)
        raise ApiError(400, str(exc), param=param) from exc
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    tracker = RequestTracker(state, time.monotonic(), request_id, params.num_samples)
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
        return StreamingResponse(sse(state, tracker, first, stream, request_id, chat, include_usage, params.n,
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
    return full_response(state, samples, params.n, request_id, kind, chat, tracker.arrival_wall, tools)


def _constraint(body: SamplingBody, tools: ToolPlan | None) -> GrammarSpec | None:
    """The request's grammar: from response_format or vLLM's fields, or from a required/named tool_choice."""
    asked = body.structured()
    forced = tools.constraint() if tools is not None else None
    if asked is not None and forced is not None:
        raise ApiError(400, f"tool_choice {tools.mode} constrains the reply already; drop {asked.param}",
                       param=asked.param)
    return asked or forced


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
