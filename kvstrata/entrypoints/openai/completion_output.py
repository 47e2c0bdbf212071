"""Completion output bodies: a whole chat or text completion (the n best samples of each prompt,
logprobs, tool calls parsed, the prompt echoed) or its server-sent events, in OpenAI's shapes.

Choice `index` is `prompt index * n + sample index`, as OpenAI numbers the choices of a batched
completion. With `echo`, a choice's text starts with its prompt and, when logprobs were asked, its
logprobs with the prompt's (the first token's logprob is null: nothing predicts it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.core.outputs import RequestOutput, TokenLogprob, best_samples
from kvstrata.entrypoints.openai.errors import ERROR_TYPES, STEP_FAILED
from kvstrata.entrypoints.openai.handoff import Transfer, decode_usage
from kvstrata.entrypoints.openai.state import ServerState
from kvstrata.entrypoints.openai.tracker import RequestTracker
from kvstrata.structured.tool_calls import ToolCallStream, ToolPlan, message

Scored = tuple[int, TokenLogprob | None]      # a token and its logprob entry (None: the prompt's first token)


@dataclass
class Job:
    """One prompt of a request: its engine request, its first output once it came, and what `echo` shows."""

    index: int
    echo: str
    tracker: RequestTracker
    stream: AsyncIterator[RequestOutput]
    first: RequestOutput | None = None


@dataclass(frozen=True)
class OutputShape:
    """How outputs become a response."""

    chat: bool
    n: int
    tools: ToolPlan | None
    hide_output: bool               # max_tokens 0: the token run for the prompt's sake is not shown
    token_ids_as_text: bool         # vLLM's return_tokens_as_token_ids
    echo_logprobs: bool             # a completion's logprobs start with the prompt's
    prompt_logprobs: bool           # vLLM's `prompt_logprobs` field, beside the choice
    predicted: bool = False         # OpenAI predicted outputs: usage counts its accepted and rejected tokens
    transfer: Transfer | None = None    # a decode handoff: usage says what was handed over and recomputed
    model: str | None = None        # the LoRA adapter it ran under, named back in `model` (None: the base's name)


def usage(finals: Sequence[RequestOutput], jobs: Sequence[Job], shape: OutputShape) -> dict:
    """Each prompt once (its samples share it), the completion tokens of every returned sample; with a
    prediction, its draft tokens the model accepted and rejected (OpenAI's completion_tokens_details)."""
    prompt = sum(job.first.num_prompt_tokens for job in jobs)
    cached = sum(job.first.num_cached_tokens for job in jobs)
    completion = 0 if shape.hide_output else sum(out.num_output_tokens for out in finals)
    body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
    if shape.predicted:
        accepted = sum(out.num_accepted_draft_tokens for out in finals)
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": sum(out.num_draft_tokens for out in finals) - accepted}
    if shape.transfer is not None:
        body["kv_transfer"] = decode_usage(shape.transfer, jobs[0].first, finals[0] if finals else None)
    return body


def _token(state: ServerState, shape: OutputShape, token_id: int) -> str:
    return f"token_id:{token_id}" if shape.token_ids_as_text else state.token_text(token_id)


def _chat_logprobs(state: ServerState, shape: OutputShape, entries: list[TokenLogprob]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = _token(state, shape, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def _completion_logprobs(state: ServerState, shape: OutputShape, entries: list[Scored], offset: int) -> dict:
    tokens = [_token(state, shape, token_id) for token_id, _ in entries]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob if e else None for _, e in entries],
            "top_logprobs": [{_token(state, shape, t): lp for t, lp in e.top} if e else None for _, e in entries],
            "text_offset": offsets}


def _prompt_logprobs(state: ServerState, first: RequestOutput) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} of the
    token itself and the top alternatives; None for the first token."""
    def entry(e: TokenLogprob) -> dict:
        scored = {str(t): {"logprob": lp, "rank": rank, "decoded_token": state.token_text(t)}
                  for rank, (t, lp) in enumerate(e.top, start=1)}
        scored.setdefault(str(e.token_id), {"logprob": e.logprob, "rank": e.rank,
                                            "decoded_token": state.token_text(e.token_id)})
        return scored
    return [entry(e) if e is not None else None for e in first.prompt_logprobs or []]


def _echoed(job: Job, shape: OutputShape) -> list[Scored]:
    """The prompt's tokens with their logprobs, as echo shows them first (none without echo_logprobs)."""
    first = job.first
    if not shape.echo_logprobs or first.prompt_logprobs is None:
        return []
    return list(zip(first.prompt_token_ids, first.prompt_logprobs))


def _choice(state: ServerState, shape: OutputShape, job: Job, final: RequestOutput) -> dict[str, Any]:
    index = job.index * shape.n + final.index
    finish = final.finish_reason if final.finished else "abort"
    text = job.echo + ("" if shape.hide_output else final.text)
    logprobs = [] if shape.hide_output else final.logprobs
    choice: dict[str, Any] = {"index": index, "finish_reason": finish}
    if shape.chat:
        choice["message"] = {"role": "assistant", "content": text}
        if shape.tools is not None:
            choice["message"], choice["finish_reason"] = message(shape.tools, text, finish)
        choice["logprobs"] = _chat_logprobs(state, shape, logprobs) if logprobs else None
    else:
        entries = _echoed(job, shape) + [(e.token_id, e) for e in logprobs]
        choice["text"] = text
        choice["logprobs"] = _completion_logprobs(state, shape, entries, 0) if entries else None
    if shape.prompt_logprobs:
        choice["prompt_logprobs"] = _prompt_logprobs(state, job.first)
    return choice


def full_response(state: ServerState, jobs: Sequence[Job], samples: list[list[list[RequestOutput]]],
                  request_id: str, shape: OutputShape, created: int) -> dict:
    """One choice per returned sample of each prompt: each sample's outputs joined, the n best kept
    (best_of); with tools, each reply parsed for tool calls."""
    choices, finals = [], []
    for job, outputs in zip(jobs, samples):
        kept = best_samples([_joined(outs) for outs in outputs if outs], shape.n)
        finals += kept
        choices += [_choice(state, shape, job, final) for final in kept]
    kind = "chat.completion" if shape.chat else "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": shape.model or state.model_name,
            "choices": choices, "usage": usage(finals, jobs, shape)}


def _joined(outputs: list[RequestOutput]) -> RequestOutput:
    """One sample's outputs as one: its whole text and logprobs, its last state."""
    return dataclasses.replace(outputs[-1], text="".join(o.text for o in outputs),
                               logprobs=[lp for o in outputs for lp in o.logprobs])


async def sse(state: ServerState, jobs: Sequence[Job], rest: AsyncIterator[tuple[Job, RequestOutput]],
              request_id: str, shape: OutputShape, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events, each choice with its index (and, with tools, its own tool-call parser); the
    client going away cancels this generator, which closes `rest` and so aborts the requests."""
    chunk_kind = "chat.completion.chunk" if shape.chat else "text_completion"
    created = jobs[0].tracker.arrival_wall
    num_choices = len(jobs) * shape.n
    offsets, started = [0] * num_choices, [False] * num_choices
    calls = [ToolCallStream(shape.tools) for _ in range(num_choices)] if shape.tools is not None else None

    def event(choices: list[dict], usage_body: dict | None = None) -> str:
        body = {"id": request_id, "object": chunk_kind, "created": created, "model": shape.model or state.model_name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage_body
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def choice(job: Job, out: RequestOutput) -> dict:
        index = job.index * shape.n + out.index
        finish = out.finish_reason if out.finished else None
        text = "" if shape.hide_output else out.text
        entries = [] if shape.hide_output else [(e.token_id, e) for e in out.logprobs]
        if not started[index]:
            started[index] = True
            text, entries = job.echo + text, _echoed(job, shape) + entries
        if shape.chat:
            delta = {"content": text} if text else {}
            if calls is not None:
                delta, finish = calls[index].delta(text, finish)
            item = {"index": index, "delta": delta, "finish_reason": finish, "logprobs":
                    _chat_logprobs(state, shape, [e for _, e in entries]) if entries else None}
        else:
            item = {"index": index, "text": text, "finish_reason": finish,
                    "logprobs": _completion_logprobs(state, shape, entries, offsets[index]) if entries else None}
        if shape.prompt_logprobs and out.prompt_logprobs is not None:
            item["prompt_logprobs"] = _prompt_logprobs(state, out)
        offsets[index] += len(text)
        return item

    try:
        if shape.chat:
            yield event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for index in range(num_choices)])
        for job in jobs:
            yield event([choice(job, job.first)])
        async for job, out in rest:
            yield event([choice(job, out)])
        latest = [out for job in jobs for out in job.tracker.latest.values()]
        if any(out.finish_reason == "error" for out in latest):     # the openai client raises
            error = {"message": STEP_FAILED, "type": ERROR_TYPES[500], "param": None, "code": "engine_step_failed"}
            yield f"data: {json.dumps({'error': error})}\n\n"
        if include_usage:
            yield event([], usage(latest, jobs, shape))
        yield "data: [DONE]\n\n"
    finally:
        await rest.aclose()
        for job in jobs:
            job.tracker.done()
