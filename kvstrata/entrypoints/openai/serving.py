"""Serving a completion: the checks common to chat and completions, the requests sent to the engine
(one per prompt: `/v1/completions` takes several), and their outputs gathered into one response or
streamed as server-sent events."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvstrata.core.disconnects import ClientGone, unless_disconnected
from kvstrata.core.outputs import RequestOutput
from kvstrata.core.sampling_params import GrammarSpec, SamplingParams
from kvstrata.engine.prompts import Prompt, Tokenized
from kvstrata.entrypoints.openai.completion_output import Job, OutputShape, full_response, sse
from kvstrata.entrypoints.openai.errors import STEP_FAILED, ApiError
from kvstrata.entrypoints.openai.handoff import Transfer, count_decode, count_prefill, prefill_answer
from kvstrata.entrypoints.openai.protocol import OpenAIModel, SamplingBody
from kvstrata.entrypoints.openai.state import ServerState
from kvstrata.entrypoints.openai.tracker import RequestTracker
from kvstrata.structured.tool_calls import ToolPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Generation:
    """What one HTTP request asks the engine for: its prompts (each with the text `echo` shows
    before its completions), the token limit and logprobs, and the response's kind."""

    prompts: Sequence[Prompt]
    echoes: Sequence[str]
    max_tokens: int | None        # 0: score the prompt, show no completion
    logprobs: int | None
    chat: bool
    tools: ToolPlan | None = None
    prediction: str | None = None       # OpenAI predicted outputs: the drafts' source
    transfer: Transfer | None = None    # its part in a prefill/decode handoff (kvstrata.entrypoints.openai.handoff)


def check_model(state: ServerState, model: str | None) -> None:
    """The base model's name, one of the LoRA adapters served, or none; else 404 naming what is served."""
    if model is not None and model != state.model_name and model not in state.engine.adapters:
        served = ", ".join(f"'{name}'" for name in (state.model_name, *state.engine.adapters))
        raise ApiError(404, f"the model '{model}' does not exist; this server serves {served}",
                       param="model", code="model_not_found")


def adapter_of(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model)."""
    return model if model is not None and model != state.model_name else None


def log_ignored(body: OpenAIModel, path: str) -> None:
    """One line naming the fields of `body` nobody defines (accepted, as vLLM accepts them, and unused)."""
    ignored = body.ignored_fields()
    if ignored:
        logger.warning("%s: ignoring fields kvstrata does not know: %s", path, ", ".join(ignored))


def check_common(state: ServerState, body: SamplingBody, path: str) -> None:
    check_model(state, body.model)
    body.refuse_unsupported()
    log_ignored(body, path)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if body.stream and (body.best_of or 1) > (body.n or 1):
        raise ApiError(400, "best_of greater than n cannot be streamed (the best are known at the end)",
                       param="best_of")


async def respond(state: ServerState, request: Request, body: SamplingBody, generation: Generation):
    chat = generation.chat
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    arrival = time.monotonic()
    transfer = generation.transfer
    hand_off = transfer is not None and transfer.role == "prefill"
    with state.queue_places(len(generation.prompts)):
        params = await state.intake.run(lambda _: _sampling(body, generation))     # a grammar compiles there
        tokenized = await _tokenized(state, body, generation, params)
        jobs = []
        for index, (prompt, echo) in enumerate(zip(tokenized, generation.echoes)):
            engine_id = request_id if len(generation.prompts) == 1 else f"{request_id}-{index}"
            jobs.append(Job(index, echo, RequestTracker(state, arrival, engine_id, params.num_samples),
                            state.engine.generate(prompt, params, engine_id, body.priority, None, hand_off,
                                                  adapter_of(state, body.model))))
        try:
            await unless_disconnected(request.is_disconnected, _first_outputs(jobs, chat, body))
        except ClientGone:       # left before its first token (a long prefill, a load): aborted there and then
            for job in jobs:
                job.tracker.done()
            return Response(status_code=499)
    if transfer is not None and transfer.role == "decode":
        count_decode(state, transfer, jobs[0].first)
    shape = OutputShape(chat, params.n, generation.tools, generation.max_tokens == 0, body.return_tokens_as_token_ids,
                        echo_logprobs=body.echo and generation.logprobs is not None and not chat,
                        prompt_logprobs=body.prompt_logprobs is not None, predicted=generation.prediction is not None,
                        transfer=transfer if transfer is not None and transfer.role == "decode" else None,
                        model=adapter_of(state, body.model))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return StreamingResponse(sse(state, jobs, _merged(jobs), request_id, shape, include_usage),
                                 media_type="text/event-stream")
    outputs = {job.index: [job.first] for job in jobs}
    try:
        async for job, out in until_disconnected(request, _merged(jobs)):
            outputs[job.index].append(out)
    finally:
        for job in jobs:
            job.tracker.done()
    if any(out.finish_reason == "error" for outs in outputs.values() for out in outs):
        raise ApiError(500, STEP_FAILED, code="engine_step_failed")
    samples = [[[out for out in outputs[job.index] if out.index == sample] for sample in range(params.num_samples)]
               for job in jobs]
    response = full_response(state, jobs, samples, request_id, shape, jobs[0].tracker.arrival_wall)
    if hand_off:
        final = outputs[0][-1]
        if final.kv_transfer is None:       # the request ended without its answer (an abort): nothing handed over
            raise ApiError(500, "the prefill ended before its blocks were handed over", code="handoff_failed")
        count_prefill(state, final)
        response["kv_transfer_params"] = prefill_answer(state, jobs[0].first, final)
    return response


def _sampling(body: SamplingBody, generation: Generation) -> SamplingParams:
    """The engine's parameters: max_tokens 0 runs one token for the prompt's sake (not shown); echo with
    logprobs on a completion scores the prompt as well."""
    max_tokens = 1 if generation.max_tokens == 0 else generation.max_tokens
    scored = [k for k in (body.prompt_logprobs, generation.logprobs if body.echo and not generation.chat else None)
              if k is not None]
    try:
        return body.sampling(max_tokens, generation.logprobs, _constraint(body, generation.tools),
                             prompt_logprobs=max(scored) if scored else None)
    except ValueError as exc:        # a schema the grammar library rejects too: nothing is queued
        param = getattr(exc, "param", None) or ("best_of" if "best_of" in str(exc) else None)
        raise ApiError(400, str(exc), param=param) from exc


async def _tokenized(state: ServerState, body: SamplingBody, generation: Generation,
                     params: SamplingParams) -> list[Tokenized]:
    """Every prompt's ids (with the bad words' and the prediction's), made on the intake's workers."""
    param = "messages" if generation.chat else "prompt"
    truncated = body.truncate_prompt_tokens is not None
    try:
        return list(await asyncio.gather(*(state.intake.tokenize(prompt, params.bad_words, generation.prediction,
                                                                 param, truncated)
                                           for prompt in generation.prompts)))
    except ValueError as exc:       # the chat template refused the messages
        raise ApiError(400, str(exc), param=param) from exc


async def _first_outputs(jobs: list[Job], chat: bool, body: SamplingBody) -> None:
    """Queue every prompt at once (shared prefixes are then computed once) and wait for each one's first
    output; if the engine refuses any, let go of all of them and answer 400."""
    firsts = await asyncio.gather(*(anext(job.stream) for job in jobs), return_exceptions=True)
    refused = next((first for first in firsts if isinstance(first, BaseException)), None)
    if refused is None:
        for job, first in zip(jobs, firsts):
            job.first = first
            job.tracker.seen(first)
        return
    for job in jobs:
        await job.stream.aclose()
    if not isinstance(refused, ValueError):
        raise refused
    param = getattr(refused, "param", "prompt")
    if param == "max_tokens" and chat and getattr(body, "max_completion_tokens", None) is not None:
        param = "max_completion_tokens"
    elif param == "prompt" and chat:
        param = "messages"
    raise ApiError(400, str(refused), param=param) from refused


async def _merged(jobs: list[Job]) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """The outputs after each job's first, as they come, tagged with their job; closing this closes every
    job's stream (which aborts what is still running)."""
    if len(jobs) == 1:
        job = jobs[0]
        try:
            if not job.tracker.finished:
                async for out in job.stream:
                    job.tracker.seen(out)
                    yield job, out
        finally:
            await job.stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            if not job.tracker.finished:
                async for out in job.stream:
                    await queue.put((job, out))
        finally:
            await job.stream.aclose()
            await queue.put((job, None))

    tasks = [asyncio.create_task(pump(job)) for job in jobs]
    try:
        live = len(jobs)
        while live:
            job, out = await queue.get()
            if out is None:
                live -= 1
                continue
            job.tracker.seen(out)
            yield job, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _constraint(body: SamplingBody, tools: ToolPlan | None) -> GrammarSpec | None:
    """The request's grammar: from response_format or vLLM's fields, or from a required/named tool_choice."""
    asked = body.structured()
    forced = tools.constraint() if tools is not None else None
    if asked is not None and forced is not None:
        raise ApiError(400, f"tool_choice {tools.mode} constrains the reply already; drop {asked.param}",
                       param=asked.param)
    return asked or forced


async def until_disconnected(request: Request, stream: AsyncIterator) -> AsyncIterator:
    """Iterate `stream`, but stop (and so abort the requests) if the client goes away meanwhile."""
    iterator = stream.__aiter__()
    try:
        while True:
            try:
                item = await unless_disconnected(request.is_disconnected, anext(iterator))
            except (ClientGone, StopAsyncIteration):
                return
            yield item
    finally:
        await iterator.aclose()
