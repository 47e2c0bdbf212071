"""Tool calls: tools rendered into the prompt, the model's calls parsed out of its reply.

`tool_choice` decides how a reply becomes calls:

    "none"      the tools are left out of the prompt; the reply is plain content
    "auto"      the model writes calls in its own format, parsed here (below); anything else is content
    "required"  the reply is constrained (a GrammarSpec) to a JSON list of {"name", "arguments"}, one
                entry per call, each holding one of the tools and that tool's parameter schema
    named       the reply is constrained to the named function's parameter schema: it is the arguments

The format parsed under "auto" is the one SmolLM2-Instruct was trained on (SmolLM2-1.7B's tool
prompt), which is also Hermes' and Qwen2.5's tag: calls inside `<tool_call>...</tool_call>`, the
body a JSON list of calls or one call object, a call being {"name": ..., "arguments": {...}}
("parameters" is read as "arguments"). Several tags may follow one another; a final tag the model
did not close is read to the end of the reply. Calls to functions not among `tools` are dropped,
and a reply with no valid call stays content.

Rendering: a chat template that knows tools (its source mentions `tools`) gets them and the
structured messages as they are. SmolLM2-135M's template does not, so the tools go into a system
prompt in the trained format, an assistant turn's calls are written back as a `<tool_call>` tag,
and a `tool` message becomes a user turn holding `<tool_response>...</tool_response>` (as the
SmolLM2 tool template does).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvstrata.core.errors import RequestRejected
from kvstrata.core.sampling_params import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TAG = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)

SYSTEM_PROMPT = """You can call functions. Given the question and the functions below, answer with one or more \
function calls when a function fits; if none fits, or a required argument is missing, say so instead.
The functions, as JSON:
<tools>{tools}</tools>
To call functions, reply with nothing but a JSON list of calls inside tool_call tags, arguments of the right types:
<tool_call>[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]</tool_call>"""


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what `tool_choice` asks of the reply."""

    tools: tuple[dict[str, Any], ...]          # OpenAI function tools: {"type": "function", "function": {...}}
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None                    # the named function
    parallel: bool = True                      # parallel_tool_calls: more than one call allowed

    @classmethod
    def from_request(cls, tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
        """None without tools; RequestRejected (param names the field) for a malformed one."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise RequestRejected("tool_choice needs tools", "tool_choice")
            return None
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(
                    function.get("name"), str) or not function["name"]:
                raise RequestRejected('each tool must be {"type": "function", "function": {"name": ...}}', "tools")
            if not isinstance(function.get("parameters", {}), dict):
                raise RequestRejected(f"tools: {function['name']}: parameters must be a JSON schema object", "tools")
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise RequestRejected("tools: function names must be distinct", "tools")
        parallel = True if parallel is None else parallel
        if tool_choice in (None, "auto", "none", "required"):
            return cls(tuple(tools), tool_choice or "auto", None, parallel)
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(
                tool_choice.get("function"), dict):
            name = tool_choice["function"].get("name")
            if name not in names:
                raise RequestRejected(f"tool_choice names '{name}', which is not among the tools", "tool_choice")
            return cls(tuple(tools), "named", name, parallel)
        raise RequestRejected('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")

    @property
    def prompt_tools(self) -> list[dict[str, Any]]:
        """The tools the prompt shows the model: none under "none", only the named one when named."""
        if self.mode == "none":
            return []
        return [t for t in self.tools if self.mode != "named" or t["function"]["name"] == self.name]

    def constraint(self) -> GrammarSpec | None:
        """The grammar "required" and named choices put on the reply (None: free text)."""
        if self.mode == "named":
            return GrammarSpec.json_schema(self._parameters(self.name), "tool_choice")
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": self._parameters(t["function"]["name"])},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return GrammarSpec.json_schema(schema, "tools")

    def _parameters(self, name: str) -> dict[str, Any]:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or {"type": "object", "properties": {}}

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a finished reply; content None when the reply was only calls."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":            # the reply is the arguments, even cut short (as streamed)
            return None, [_call(self.name, text)]
        if self.mode == "required":
            found = _json(text)
            if not isinstance(found, list):
                return text, []
            return None, [_call(c["name"], c["arguments"]) for c in found]
        return self._parse_auto(text)

    def _parse_auto(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        names = {t["function"]["name"] for t in self.prompt_tools}
        calls = []
        for match in _TAG.finditer(text):
            body = _json(match.group(1).strip())
            for item in body if isinstance(body, list) else [body]:
                if not isinstance(item, dict) or item.get("name") not in names:
                    continue
                arguments = item.get("arguments", item.get("parameters", {}))
                if isinstance(arguments, str):
                    arguments = _json(arguments)
                if isinstance(arguments, dict):
                    calls.append(_call(item["name"], arguments))
        if not calls:
            return text, []
        content = _TAG.sub("", text).strip()
        return content or None, calls if self.parallel else calls[:1]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    """One call as OpenAI sends it: `arguments` is JSON text."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


# ---- the reply, as the openai client reads it -------------------------------------------------------
def message(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished reply and its finish reason ("tool_calls" when it called)."""
    content, calls = plan.calls(text)
    if not calls:
        return {"role": "assistant", "content": content}, finish_reason
    return ({"role": "assistant", "content": content, "tool_calls": calls},
            "tool_calls" if finish_reason == "stop" else finish_reason)


class ToolCallStream:
    """Turns a streamed reply into `delta`s: content while it can only be content, calls at the end.

    A named call streams its arguments as they come (the first delta names the function). Under
    "auto", text is sent as content until a `<tool_call>` tag may be starting; from there it is held
    and parsed when the reply ends. "required" replies are parsed when they end.
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0                     # characters of `text` already sent as content (or arguments)
        self._named_id = f"call_{uuid.uuid4().hex[:24]}"

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta for `new_text`, and the finish reason to send (None until the reply ends)."""
        self.text += new_text
        if self.plan.mode == "named":
            return self._named(finish_reason)
        if finish_reason is None:
            if self.plan.mode == "required":
                return {}, None
            upto = _safe_content_end(self.text) if self.plan.mode == "auto" else len(self.text)
            return self._content(upto), None
        content, calls = self.plan.calls(self.text) if self.plan.mode != "none" else (self.text, [])
        if not calls:
            return self._content(len(self.text)), finish_reason
        held = self.text[self.sent:]
        delta: dict[str, Any] = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        before = held.split(OPEN, 1)[0] if self.plan.mode == "auto" else ""
        if before.strip():
            delta["content"] = before
        return delta, "tool_calls" if finish_reason == "stop" else finish_reason

    def _content(self, upto: int) -> dict[str, Any]:
        piece, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return {"content": piece} if piece else {}

    def _named(self, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        piece = self.text[self.sent:]
        call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
        if self.sent == 0:
            call.update(id=self._named_id, type="function", function={"name": self.plan.name, "arguments": piece})
        self.sent = len(self.text)
        delta = {"tool_calls": [call]} if piece or call.get("id") else {}
        if finish_reason == "stop":
            finish_reason = "tool_calls"
        return delta, finish_reason


def _safe_content_end(text: str) -> int:
    """How much of `text` is surely content: up to a `<tool_call>` tag, or to a suffix that may begin one."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


# ---- rendering the conversation ------------------------------------------------------------------------
def render_chat(tokenizer: Any, template: str, messages: Sequence[dict[str, Any]],
                tools: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation with tools and tool turns, through `template` (the model's,
    or the request's own); `continue_final_message` leaves the last message open for the reply."""
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    options = {"chat_template": template, "tokenize": False, "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message, **(template_kwargs or {})}
    if "tools" in template or not (tools or has_tool_turns):
        return tokenizer.apply_chat_template(list(messages), tools=list(tools) or None, **options)
    return tokenizer.apply_chat_template(inline_tools(messages, tools), **options)


def inline_tools(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Plain {role, content} messages for a template without tools: tools in the system prompt, calls
    and results as the tags the model was trained on."""
    out: list[dict[str, str]] = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _json(c["function"]["arguments"])
                      if isinstance(c["function"]["arguments"], str) else c["function"]["arguments"]}
                     for c in m["tool_calls"]]
            content = (content + "\n" if content else "") + OPEN + json.dumps(calls, ensure_ascii=False) + CLOSE
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    if tools:
        listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
        system = SYSTEM_PROMPT.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": system + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out
