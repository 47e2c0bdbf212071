"""A conversation in the Responses API's items, as the chat messages the model's template renders.

Items read: messages (`{"role", "content"}`, with or without `"type": "message"`; content a string
or `input_text` / `output_text` parts), `function_call` (`{"call_id", "name", "arguments"}`) and
`function_call_output` (`{"call_id", "output"}`). A response's own output items are of these kinds,
so a stored turn is read back through here too, and renders as the reply the model wrote: the
next turn's prompt then begins with this turn's prompt and reply, a prefix-cache hit.
"""

from __future__ import annotations

from typing import Any

from kvstrata.entrypoints.openai.errors import ApiError

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")


def chat_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`{"role", "content"}` messages (an assistant's with `tool_calls`, a tool result with
    `tool_call_id`), as chat's messages are handed to the engine; ApiError naming the item if one is
    not read here. A function call joins the assistant message just before it, as one reply."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise ApiError(400, "input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(index, item))
        elif kind == "function_call":
            call = {"id": _string(index, item, "call_id"), "type": "function",
                    "function": {"name": _string(index, item, "name"), "arguments": _string(index, item, "arguments")}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(index, item, "call_id"),
                             "content": output if isinstance(output, str) else _text(index, output, "output")})
        else:
            raise _refused(index, f"items of type {kind!r} are not supported; send messages, function_call and "
                                  "function_call_output items")
    return messages


def _message(index: int, item: dict[str, Any]) -> dict[str, Any]:
    role = ROLES.get(item.get("role"))
    if role is None:
        raise _refused(index, f"role must be one of {', '.join(ROLES)}")
    content = item.get("content")
    return {"role": role, "content": content if isinstance(content, str) else _text(index, content, "content")}


def _text(index: int, parts: Any, field: str) -> str:
    if not isinstance(parts, list):
        raise _refused(index, f"{field} must be a string or a list of text parts")
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _refused(index, f"{field}: only text parts ({', '.join(TEXT_PARTS)}) are supported, not {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _string(index: int, item: dict[str, Any], field: str) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise _refused(index, f"a {item.get('type')} item needs {field} (a string)")
    return value


def _refused(index: int, message: str) -> ApiError:
    return ApiError(400, f"input[{index}]: {message}", param="input")
