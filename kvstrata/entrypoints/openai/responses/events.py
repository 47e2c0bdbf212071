"""A streamed response's server-sent events, in the order OpenAI sends them:

    response.created, response.in_progress
    a message:       output_item.added, content_part.added, output_text.delta ..., output_text.done,
                     content_part.done, output_item.done
    a function call: output_item.added, function_call_arguments.delta ..., function_call_arguments.done,
                     output_item.done
    response.completed (or response.incomplete, response.failed)

each as `event: <type>` and `data: <json>` with a `sequence_number` counting from 0. What is text and
what is a call is decided as for chat's stream (ToolCallStream): a named call's arguments stream as
they come, "auto" and "required" calls arrive whole when the reply ends.
"""

from __future__ import annotations

import json
from typing import Any

from kvstrata.core.outputs import RequestOutput
from kvstrata.entrypoints.openai.responses.output import call_item, message_item, new_id, output_text
from kvstrata.structured.tool_calls import ToolCallStream, ToolPlan


class ResponseEvents:
    """Turns one reply's outputs into events, and keeps the output items they built (`output`)."""

    def __init__(self, tools: ToolPlan | None):
        self.calls = ToolCallStream(tools) if tools is not None else None
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self._message: int | None = None            # output index of the open message item
        self._open_calls: dict[int, int] = {}       # the stream's call index -> its output index

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def step(self, out: RequestOutput) -> list[str]:
        """The events for one output's new text."""
        if self.calls is None:
            delta = {"content": out.text} if out.text else {}
        else:
            delta, _ = self.calls.delta(out.text, out.finish_reason if out.finished else None)
        events = self._text(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls", []):
            events += self._call(call)
        return events

    def finish(self, status: str) -> list[str]:
        """Close every open item (a reply with neither text nor calls still gets its empty message)."""
        item_status = "completed" if status == "completed" else "incomplete"
        events = self._text("") if not self.output else []
        events += self._close_message(item_status)
        for index in self._open_calls.values():
            item = self.output[index]
            item["status"] = item_status
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        self._open_calls.clear()
        return events

    def _text(self, piece: str) -> list[str]:
        events = []
        if self._message is None:
            self._message = len(self.output)
            self.output.append(message_item(new_id("msg"), "in_progress", []))
            item = self.output[self._message]
            events.append(self.event("response.output_item.added", output_index=self._message, item=item))
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._message,
                                     content_index=0, part=output_text("")))
            item["content"].append(output_text(""))
        item = self.output[self._message]
        if piece:
            item["content"][0]["text"] += piece
            events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self._message,
                                     content_index=0, delta=piece, logprobs=[]))
        return events

    def _close_message(self, item_status: str) -> list[str]:
        if self._message is None:
            return []
        index, item = self._message, self.output[self._message]
        part = item["content"][0]
        item["status"] = item_status
        self._message = None
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call: dict[str, Any]) -> list[str]:
        """A call's first delta (it has an id) opens its item; every delta may add to its arguments."""
        events = []
        if "id" in call:
            events += self._close_message("completed")
            self._open_calls[call["index"]] = len(self.output)
            item = call_item(new_id("fc"), "in_progress", {"id": call["id"], "function": {
                "name": call["function"]["name"], "arguments": ""}})
            self.output.append(item)
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        index = self._open_calls[call["index"]]
        item, piece = self.output[index], call["function"].get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                     delta=piece))
        return events
