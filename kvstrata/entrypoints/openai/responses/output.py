"""The Response object as OpenAI returns it: the output items of a reply, its usage, its status, and
the request's parameters echoed back."""

from __future__ import annotations

import uuid
from typing import Any

from kvstrata.core.outputs import RequestOutput
from kvstrata.entrypoints.openai.responses.protocol import ResponsesRequest
from kvstrata.structured.tool_calls import ToolPlan

# A finish reason as a response's status; a reply cut by max_output_tokens (or the context) is incomplete.
STATUS = {"stop": "completed", "length": "incomplete", "error": "failed"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(final: RequestOutput) -> str:
    return STATUS.get(final.finish_reason, "incomplete") if final.finished else "incomplete"


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, status: str, call: dict[str, Any]) -> dict[str, Any]:
    """A function_call item from a call as chat sends it (`{"id", "function": {"name", "arguments"}}`)."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def output_items(tools: ToolPlan | None, text: str, status: str) -> list[dict[str, Any]]:
    """A finished reply's items: a message (unless the reply was only calls), then its function calls."""
    content, calls = tools.calls(text) if tools is not None else (text, [])
    item_status = "completed" if status == "completed" else "incomplete"
    items = [message_item(new_id("msg"), item_status, [output_text(content)])] if content is not None else []
    return items + [call_item(new_id("fc"), item_status, call) for call in calls]


def usage(final: RequestOutput) -> dict[str, Any]:
    return {"input_tokens": final.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": final.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": final.num_prompt_tokens + final.num_output_tokens}


def response_body(body: ResponsesRequest, model: str, response_id: str, created_at: int, status: str,
                  output: list[dict[str, Any]], final: RequestOutput | None = None,
                  error: dict[str, str] | None = None) -> dict[str, Any]:
    """The Response: `final` (the last output) gives the usage once it ended; `error` a failed one's."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
        "model": model, "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "service_tier": "default", "store": body.store, "temperature": body.effective_temperature,
        "text": body.text or {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [], "top_logprobs": 0, "top_p": body.effective_top_p, "truncation": "disabled",
        "usage": usage(final) if final is not None and status != "in_progress" else None,
        "user": body.user, "metadata": body.metadata or {},
    }
