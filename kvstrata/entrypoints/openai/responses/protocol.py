"""The request body of /v1/responses (pydantic), and what it asks of the engine: tools in the shape
ToolPlan reads, the grammar of `text.format`, the sampling parameters.

Parameters OpenAI defines that kvstrata cannot honour are refused with 400 naming the field (see
UNSUPPORTED), never silently ignored; unknown fields are refused too.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from kvstrata.core.errors import RequestRejected
from kvstrata.core.sampling_params import GrammarSpec, SamplingParams
from kvstrata.entrypoints.openai.errors import ApiError
from kvstrata.entrypoints.openai.protocol import OpenAIModel
from kvstrata.structured.grammar import compile_grammar
from kvstrata.structured.tool_calls import ToolPlan

MAX_METADATA = 16       # key-value pairs, as OpenAI

# Defined by OpenAI, not honoured here: a request that sets one to anything but null or this value gets 400.
UNSUPPORTED: dict[str, Any] = {
    "reasoning": None, "background": False, "include": [], "max_tool_calls": None, "top_logprobs": 0,
    "service_tier": "auto", "conversation": None, "prompt": None, "truncation": "disabled",
}
_WHY = {
    "reasoning": "the model does not reason",
    "background": "responses are computed while the request is open; leave background false",
    "include": "kvstrata produces none of the extra outputs it could name",
    "truncation": "a conversation longer than the context is refused, never cut",
    "conversation": "chain turns with previous_response_id",
    "prompt": "no stored prompt templates; send input (and instructions)",
}


class ResponsesStreamOptions(OpenAIModel):
    include_obfuscation: bool = True


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses. `input` items are read by kvstrata.entrypoints.openai.responses.conversation.
    Fields nobody defines are ignored with a log line, as on chat."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Defined by OpenAI, refused unless null or as in UNSUPPORTED.
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    def refuse_unsupported(self) -> None:
        for name, allowed in UNSUPPORTED.items():
            value = getattr(self, name)
            if value is None or value == allowed:
                continue
            why = f": {_WHY[name]}" if name in _WHY else ""
            raise ApiError(400, f"'{name}' is not supported by kvstrata (only null or {json.dumps(allowed)}){why}",
                           param=name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if self.metadata is not None and len(self.metadata) > MAX_METADATA:
            raise ApiError(400, f"metadata holds at most {MAX_METADATA} pairs", param="metadata")

    def tool_plan(self) -> ToolPlan | None:
        """The tools and tool_choice in the shape chat sends them (`{"type": "function", "function": {...}}`)."""
        tools = [_chat_tool(i, tool) for i, tool in enumerate(self.tools or [])]
        try:
            return ToolPlan.from_request(tools, _chat_tool_choice(self.tool_choice), self.parallel_tool_calls)
        except RequestRejected as exc:
            raise ApiError(400, str(exc), param=exc.param) from exc

    def sampling(self, tools: ToolPlan | None) -> SamplingParams:
        """max_output_tokens None: up to the context length. The grammar (of `text.format`, or of a
        forcing tool_choice) is compiled here, off the engine thread."""
        asked, forced = self._format(), tools.constraint() if tools is not None else None
        if asked is not None and forced is not None:
            raise ApiError(400, f"tool_choice {tools.mode} constrains the reply already; drop text.format",
                           param="text")
        try:
            params = SamplingParams(max_tokens=self.max_output_tokens, temperature=self.effective_temperature,
                                    top_p=self.effective_top_p, structured=asked or forced).validate()
            if params.structured is not None:
                compile_grammar(params.structured)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from exc
        return params

    @property
    def effective_temperature(self) -> float:
        return 1.0 if self.temperature is None else self.temperature

    @property
    def effective_top_p(self) -> float:
        return 1.0 if self.top_p is None else self.top_p

    def _format(self) -> GrammarSpec | None:
        """`text.format`: text (no grammar), json_object, or json_schema `{"name", "schema", "strict"}`
        (the schema is enforced whatever `strict` says, as chat's response_format)."""
        text = self.text or {}
        unknown = sorted(set(text) - {"format", "verbosity"})
        if unknown or text.get("verbosity") not in (None, "medium"):
            raise ApiError(400, f"text: only format is supported, not {', '.join(unknown) or 'verbosity'}",
                           param="text")
        form = text.get("format") or {"type": "text"}
        if form.get("type") == "text":
            return None
        if form.get("type") == "json_object":
            return GrammarSpec("json_object", "", "text")
        if form.get("type") == "json_schema" and "schema" in form:
            try:
                return GrammarSpec.json_schema(form["schema"], "text")
            except RequestRejected as exc:
                raise ApiError(400, str(exc), param="text") from exc
        raise ApiError(400, 'text.format must be {"type": "text"}, {"type": "json_object"} or '
                            '{"type": "json_schema", "name": ..., "schema": {...}}', param="text")


def _chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool `{"type": "function", "name", "description", "parameters", "strict"}`
    as chat's `{"type": "function", "function": {"name", "description", "parameters"}}`."""
    if tool.get("type") != "function":
        raise ApiError(400, f"tools[{index}]: kvstrata serves function tools only, not {tool.get('type')!r}",
                       param="tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ApiError(400, f"tools[{index}]: a function tool needs a name", param="tools")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`{"type": "function", "name"}` as chat's `{"type": "function", "function": {"name"}}`."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                       param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}
