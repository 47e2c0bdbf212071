"""Completion output bodies: a whole chat or text completion (the n best samples, logprobs, tool calls
parsed) or its server-sent events, in OpenAI's shapes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvstrata.core.outputs import RequestOutput, TokenLogprob, best_samples
from kvstrata.entrypoints.openai.errors import ERROR_TYPES, STEP_FAILED
from kvstrata.entrypoints.openai.state import ServerState
from kvstrata.entrypoints.openai.tracker import RequestTracker
from kvstrata.structured.tool_calls import ToolCallStream, ToolPlan, message


def usage(finals: Sequence[RequestOutput]) -> dict:
    """The prompt once (its samples share it), the completion tokens of every returned sample."""
    first, completion = finals[0], sum(out.num_output_tokens for out in finals)
    return {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens}}


def _chat_logprobs(state: ServerState, entries: list[TokenLogprob]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = state.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def _completion_logprobs(state: ServerState, entries: list[TokenLogprob], offset: int) -> dict:
    tokens = [state.token_text(e.token_id) for e in entries]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{state.token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def full_response(state: ServerState, samples: list[list[RequestOutput]], n: int, request_id: str, kind: str,
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
            "choices": choices, "usage": usage(finals)}


def _joined(outputs: list[RequestOutput]) -> RequestOutput:
    """One sample's outputs as one: its whole text and logprobs, its last state."""
    return dataclasses.replace(outputs[-1], text="".join(o.text for o in outputs),
                               logprobs=[lp for o in outputs for lp in o.logprobs])


async def sse(state: ServerState, tracker: RequestTracker, first: RequestOutput, stream: AsyncIterator[RequestOutput],
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
            yield event([], usage([tracker.latest[index] for index in sorted(tracker.latest)]))
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()
        tracker.done()
