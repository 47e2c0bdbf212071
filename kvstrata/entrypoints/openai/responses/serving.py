"""Serving a response: the conversation (the stored one named by `previous_response_id`, then the new
input) sent to the engine as a chat, its reply gathered into a Response or streamed as events, and
the finished response stored.

Built from chat's pieces: the request goes through `AsyncLLMEngine.generate` as a ChatPrompt, its
latency and request-log line through RequestTracker, a client that leaves aborts it (serving's
`until_disconnected`, and a cancelled event stream); only the shapes of the body and events differ.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvstrata.core.outputs import RequestOutput
from kvstrata.engine.prompts import ChatPrompt
from kvstrata.entrypoints.openai.errors import STEP_FAILED, ApiError
from kvstrata.entrypoints.openai.responses.conversation import chat_messages
from kvstrata.entrypoints.openai.responses.events import ResponseEvents
from kvstrata.entrypoints.openai.responses.output import new_id, output_items, response_body, status_of
from kvstrata.entrypoints.openai.responses.protocol import ResponsesRequest
from kvstrata.entrypoints.openai.responses.store import ResponseStore, StoredResponse
from kvstrata.entrypoints.openai.serving import adapter_of, check_model, log_ignored, until_disconnected
from kvstrata.entrypoints.openai.state import ServerState
from kvstrata.entrypoints.openai.tracker import RequestTracker
from kvstrata.structured.tool_calls import ToolPlan

# The engine's name for a refused input, as this API calls it.
PARAMS = {"prompt": "input", "max_tokens": "max_output_tokens"}
FAILED = {"code": "server_error", "message": STEP_FAILED}
FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


async def create_response(state: ServerState, store: ResponseStore, request: Request, body: ResponsesRequest):
    """The Response, or its events; ApiError, with nothing queued, for a request that cannot run."""
    check_model(state, body.model)
    body.refuse_unsupported()
    log_ignored(body, request.url.path)
    history = _history(store, body.previous_response_id)
    conversation = [*history, *chat_messages(body.input)]
    tools = body.tool_plan()
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    prompt = ChatPrompt(tuple(instructions + conversation), tuple(tools.prompt_tools) if tools else ())
    response_id = new_id("resp")
    with state.queue_places(1):
        params = await state.intake.run(lambda _: body.sampling(tools))      # a grammar compiles there
        tracker = RequestTracker(state, time.monotonic(), response_id)
        try:
            tokenized = await state.intake.tokenize(prompt, params.bad_words, param="input")
            stream = state.engine.generate(tokenized, params, response_id, lora=adapter_of(state, body.model))
            first = await anext(stream)
        except ValueError as exc:        # refused (too long, bad template input): nothing queued
            param = getattr(exc, "param", "prompt")
            raise ApiError(400, str(exc), param=PARAMS.get(param, param)) from exc
    tracker.seen(first)
    turn = _Turn(state, store, body, response_id, tracker.arrival_wall, conversation)
    if body.stream:
        return StreamingResponse(_events(turn, tracker, first, stream, tools), media_type="text/event-stream")
    outputs = [first]
    try:
        if not tracker.finished:
            async for out in until_disconnected(request, stream):
                tracker.seen(out)
                outputs.append(out)
    finally:
        tracker.done()
    final = tracker.last
    if final.finish_reason == "error":
        raise ApiError(500, STEP_FAILED, code="engine_step_failed")
    status = status_of(final)
    return turn.finish(status, output_items(tools, "".join(out.text for out in outputs), status), final,
                       keep=tracker.finished)


def _history(store: ResponseStore, previous_response_id: str | None) -> tuple[dict, ...]:
    if previous_response_id is None:
        return ()
    previous = store.get(previous_response_id)
    if previous is None:
        raise ApiError(404, f"no stored response '{previous_response_id}' (never stored, deleted, or among the "
                            f"oldest past the last {store.capacity} kept): send the whole conversation instead",
                       param="previous_response_id", code="previous_response_not_found")
    return previous.messages


@dataclass
class _Turn:
    """One response being served: what it needs to become a body, and to be stored once finished."""

    state: ServerState
    store: ResponseStore
    body: ResponsesRequest
    response_id: str
    created_at: int
    conversation: list[dict]             # the input after the previous turns, without the instructions

    def body_of(self, status: str, output: list[dict], final: RequestOutput | None = None) -> dict:
        return response_body(self.body, adapter_of(self.state, self.body.model) or self.state.model_name, self.response_id, self.created_at, status, output,
                             final, FAILED if status == "failed" else None)

    def finish(self, status: str, output: list[dict], final: RequestOutput, keep: bool) -> dict:
        """The finished body; stored (with the conversation through its reply) when asked and `keep`."""
        body = self.body_of(status, output, final)
        if self.body.store and keep and status != "failed":
            reply = chat_messages(output) if output else []
            self.store.put(self.response_id, StoredResponse(body, (*self.conversation, *reply)))
        return body


async def _events(turn: _Turn, tracker: RequestTracker, first: RequestOutput, stream: AsyncIterator[RequestOutput],
                  tools: ToolPlan | None) -> AsyncIterator[str]:
    """The event stream; the client going away cancels this generator, which aborts the request."""
    events = ResponseEvents(tools)
    try:
        started = turn.body_of("in_progress", [])
        yield events.event("response.created", response=started)
        yield events.event("response.in_progress", response=started)
        for event in events.step(first):
            yield event
        if not tracker.finished:
            async for out in stream:
                tracker.seen(out)
                for event in events.step(out):
                    yield event
        status = status_of(tracker.last)
        for event in events.finish(status):
            yield event
        body = turn.finish(status, events.output, tracker.last, keep=True)
        yield events.event(FINAL_EVENTS[status], response=body)
    finally:
        await stream.aclose()
        tracker.done()
