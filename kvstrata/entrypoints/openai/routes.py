"""The endpoints: OpenAI's /v1/chat/completions, /v1/completions and /v1/models[/{id}]; /health and
/metrics; vLLM's /tokenize, /detokenize and /version; /v1/kv_events for routers.

Handlers read only what the engine thread published (`engine.snapshot`, `engine.kv_events`, the
build-time facts in ServerState) and tokenize with the server's own tokenizer (`state.prompts`).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstrata import __version__
from kvstrata.engine.prompts import ChatPrompt
from kvstrata.entrypoints.openai.errors import ApiError, error_response
from kvstrata.entrypoints.openai.handoff import transfer_of
from kvstrata.entrypoints.openai.protocol import (
    COMPLETION_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingBody,
    TokenizeRequest,
    chat_messages,
)
from kvstrata.entrypoints.openai.serving import Generation, check_common, check_model, respond
from kvstrata.entrypoints.openai.state import ServerState
from kvstrata.structured.tool_calls import ToolPlan

router = APIRouter()

MAX_CHOICES = 256     # prompts times n in one /v1/completions request (each prompt is a request of its own)


def _state(request: Request) -> ServerState:
    return request.app.state.kvstrata


@router.get("/health")
async def health(request: Request):
    engine = _state(request).engine
    if engine.error is not None:
        return error_response(503, f"engine failed: {engine.error!r}")
    return {"status": "ok", "disaggregation_mode": _state(request).disaggregation_mode}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/kv_events")
async def kv_events(request: Request, since: int = 0, instance: str | None = None,
                    timeout: float = Query(0.0, ge=0.0, le=30.0)):
    """What the caches hold, for routers (kvstrata.engine.kv_events): long-polls up to `timeout` seconds."""
    events = _state(request).engine.kv_events
    if events is None:
        raise ApiError(404, "this engine does not publish KV events")
    return await events.poll(since, instance, timeout)


@router.get("/v1/timelines")
async def timelines(request: Request, id: list[str] = Query(default_factory=list)):     # noqa: A002 - the query's name
    """Where the named requests' time went (kvstrata.core.timeline), for the last requests served."""
    return {"timelines": _state(request).timelines.get(id)}


@router.get("/version")
async def version():
    return {"version": __version__}


def _card(state: ServerState, model_id: str) -> dict:
    """The base model's card, or a LoRA adapter's (its folder as `root`, the base as `parent`, as vLLM)."""
    adapter = model_id != state.model_name
    card = {"id": model_id, "object": "model", "created": state.created, "owned_by": "kvstrata",
            "root": state.engine.adapters[model_id] if adapter else model_id,
            "parent": state.model_name if adapter else None, "max_model_len": state.max_model_len}
    return card if adapter else {**card, "runs": dict(state.engine.info.runs)}


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    return {"object": "list", "data": [_card(state, name) for name in (state.model_name, *state.engine.adapters)]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    state = _state(request)
    check_model(state, model_id)
    return _card(state, model_id)


@router.post("/tokenize")
async def tokenize(request: Request, body: TokenizeRequest):
    state = _state(request)
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send either 'prompt' or 'messages'", param="prompt")
    param = "messages" if body.messages is not None else "prompt"
    prompt = ChatPrompt(tuple(chat_messages(body.messages))) if body.messages is not None else body.prompt
    state.intake.check_length(prompt, param)

    def answer(encoder) -> bytes:
        """The reply's bytes, made on the worker too: FastAPI's encoder would walk a long text's ids one by
        one on the event loop."""
        ids = encoder.encode(prompt) if body.messages is not None else \
            encoder.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return json.dumps({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}).encode()

    try:
        return Response(await state.intake.run(answer), media_type="application/json")
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from exc


def check_token_ids(state: ServerState, prompts: list[list[int]], param: str) -> None:
    """A 400 for an id outside the vocabulary, before anything decodes it (the engine checks again at admission)."""
    if any(not 0 <= t < state.vocab_size for ids in prompts for t in ids):
        raise ApiError(400, f"token ids must be in [0, {state.vocab_size})", param=param)


@router.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeRequest):
    state = _state(request)
    check_model(state, body.model)
    state.intake.check_length(body.tokens, "tokens")
    check_token_ids(state, [body.tokens], "tokens")
    return {"prompt": await state.intake.run(lambda encoder: encoder.decode(body.tokens))}


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request):
    state = _state(request)
    check_common(state, body, request.url.path)
    transfer = transfer_of(state, body, 1)
    messages = chat_messages(body.messages)
    try:
        tools = ToolPlan.from_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from exc
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    prompt = ChatPrompt(tuple(messages), tuple(tools.prompt_tools) if tools else (), body.chat_template,
                        tuple((body.chat_template_kwargs or {}).items()), body.add_generation_prompt,
                        body.continue_final_message)
    if transfer is not None:
        prompt, max_tokens = transfer.prompt_token_ids or prompt, 1 if transfer.role == "prefill" else max_tokens
    # vLLM's chat echo: the reply is shown after the last message when that one is the assistant's own
    echo = messages[-1]["content"] if body.echo and messages[-1]["role"] == "assistant" else ""
    return await respond(state, request, body, Generation([prompt], [echo], max_tokens, logprobs, True, tools,
                                                          _prediction(body), transfer))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = _state(request)
    check_common(state, body, request.url.path)
    prompt = body.prompt
    prompts = list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    if not prompts or any(not p for p in prompts):
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if len(prompts) * (body.n or 1) > MAX_CHOICES:
        raise ApiError(400, f"at most {MAX_CHOICES} choices per request (prompts times n)", param="prompt")
    if body.truncate_prompt_tokens is None:
        for p in prompts:
            state.intake.check_length(p, "prompt")
    check_token_ids(state, [p for p in prompts if not isinstance(p, str)], "prompt")    # before echo decodes them
    echoes = [(p if isinstance(p, str) else await state.intake.run(lambda encoder, ids=p: encoder.decode(ids)))
              if body.echo else "" for p in prompts]
    max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    transfer = transfer_of(state, body, len(prompts))
    if transfer is not None:
        prompts, max_tokens = [transfer.prompt_token_ids or prompts[0]], 1 if transfer.role == "prefill" else max_tokens
    return await respond(state, request, body, Generation(prompts, echoes, max_tokens, body.logprobs, False,
                                                          prediction=_prediction(body), transfer=transfer))


def _prediction(body: SamplingBody) -> str | None:
    return body.prediction.text() if body.prediction is not None else None
