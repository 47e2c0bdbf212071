"""The generated parts of docs/serving-api.md and docs/configuration.md, rendered from the code.

    python -m kvstrata.entrypoints.cli.reference           rewrite them (`make docs`)
    python -m kvstrata.entrypoints.cli.reference --check   exit 1 if either is stale

The serving API's tables come from the routes (kvstrata.entrypoints.openai.routes and .responses.routes)
and the request models (kvstrata.entrypoints.openai.protocol and .responses.protocol; a field in either's
`UNSUPPORTED` is refused); the configuration
from the argparse parser of every command (`build_parser`), so neither can drift from the code.
What a field or an endpoint does is written here, once: rendering fails on one without it.
Each generated part sits between `<!-- reference:NAME:begin -->` and `<!-- reference:NAME:end -->`;
the prose around it is hand-written and left alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kvstrata.core.config import format_size, parse_size
from kvstrata.entrypoints.cli.main import build_parser
from kvstrata.entrypoints.openai import protocol
from kvstrata.entrypoints.openai.adapter_routes import adapter_router
from kvstrata.entrypoints.openai.responses import protocol as responses_protocol
from kvstrata.entrypoints.openai.responses.routes import responses_router
from kvstrata.entrypoints.openai.responses.store import MAX_STORED_RESPONSES
from kvstrata.entrypoints.openai.routes import router

BODIES: tuple[type[BaseModel], ...] = (protocol.SamplingBody, protocol.ChatRequest, protocol.CompletionRequest,
                                       protocol.ChatMessage, protocol.StreamOptions, protocol.Prediction,
                                       protocol.KVTransferParams,
                                       protocol.TokenizeRequest,
                                       protocol.DetokenizeRequest, protocol.LoadLoRARequest,
                                       protocol.UnloadLoRARequest, responses_protocol.ResponsesRequest,
                                       responses_protocol.ResponsesStreamOptions)
# The fields each body refuses unless left at null or the value given.
REFUSED: dict[type[BaseModel], dict[str, Any]] = {protocol.SamplingBody: protocol.UNSUPPORTED,
                                                  responses_protocol.ResponsesRequest: responses_protocol.UNSUPPORTED}

# What each endpoint does, by path, or by "METHOD path" where a path serves several methods.
ENDPOINTS: dict[str, str] = {
    "/v1/chat/completions": "a chat reply (streamed with `stream: true`)",
    "/v1/completions": "a text completion of a prompt (streamed with `stream: true`)",
    "/v1/models": "the served model, with its `max_model_len` and what runs (`runs`: the weight format, dtype, KV "
                  "cache dtype, a step's path and the ISA level of kvstrata's kernels), then each LoRA adapter served "
                  "(its folder as `root`, the model as `parent`)",
    "/v1/models/{model_id:path}": "the served model or an adapter by name; any other name is 404",
    "/v1/load_lora_adapter": "vLLM's: serve the PEFT adapter at `lora_path` as `lora_name` (only with --enable-lora "
                             "--allow-runtime-lora-updating, else 404; beneath a --lora-root when given); read and "
                             "checked first, off the engine thread: any path it cannot serve is one 400, \"cannot load "
                             "a LoRA adapter from this path\", and changes nothing",
    "/v1/unload_lora_adapter": "vLLM's: stop serving an adapter (its requests in flight finish); 404 if unknown "
                               "(only with --allow-runtime-lora-updating, else 404 whatever the body)",
    "/tokenize": "vLLM's: the token ids a completion or chat request would see",
    "/detokenize": "vLLM's: token ids back to text",
    "/version": "kvstrata's version",
    "/v1/timelines": "where the named requests' time went (`?id=A&id=B`: queued, loads, prefill and decode "
                     "steps, the waits between them), for the last 4,096 requests served; `kvstrata bench` reads it",
    "/health": "200 while the engine runs; 503 once it has failed",
    "/metrics": "Prometheus metrics (see below)",
    "/v1/kv_events": "for `kvstrata router`: block hashes stored and removed per tier after `since`, or a "
                     "snapshot, and the engine's load; waits up to `timeout` seconds (at most 30)",
    "/v1/responses": "OpenAI's Responses API: a reply to `input`, after the stored conversation of "
                     "`previous_response_id` (streamed as events with `stream: true`)",
    "GET /v1/responses/{response_id}": "a stored response, whole (`stream=true`, its events again, is 400); 404 "
                                       "when none is stored",
    "DELETE /v1/responses/{response_id}": "forget a stored response; 404 when none is stored",
}

# What each field does, by `Model.field` where the name means different things in two bodies, else by name.
FIELDS: dict[str, str] = {
    "model": "the served model's name, or a LoRA adapter's to run under it; another is 404 (`model_not_found`)",
    "lora_name": "the name requests give as `model` to run under the adapter",
    "lora_path": "a PEFT folder on the server: adapter_config.json + adapter_model.safetensors, beneath a "
                 "--lora-root once symlinks are resolved",
    "load_inplace": "replace the weights of an adapter already loaded under this name (its new requests never "
                    "reach blocks cached under the old weights)",
    "max_tokens": "most tokens to generate; chat without it: until the model stops or the context ends, "
                  "`/v1/completions` without it: 16",
    "temperature": "0 is greedy",
    "top_p": "keep the smallest set of tokens whose probabilities reach `top_p`",
    "top_k": "keep the `top_k` most likely tokens; 0 is off",
    "min_p": "drop tokens below `min_p` times the top token's probability",
    "presence_penalty": "subtracted from the logit of every token already in the output",
    "frequency_penalty": "subtracted, times its count in the output, from a token's logit",
    "repetition_penalty": "divides positive logits (multiplies negative ones) of tokens in the prompt or "
                          "output; 1 is off",
    "seed": "the same seed gives the same tokens whatever shares the batch; sample i of `n` draws from "
            "`seed + i`",
    "stop": "at most 16 non-empty strings; the output ends before the first one",
    "stop_token_ids": "token ids that end the output as EOS does",
    "stream": "server-sent events, one chunk per step, then `data: [DONE]`",
    "stream_options": "`include_usage` (below); only with `stream: true`",
    "ignore_eos": "generate past EOS, up to `max_tokens`; not with a grammar",
    "min_tokens": "EOS and `stop_token_ids` are masked until this many tokens exist; not with a grammar",
    "priority": "under `--policy priority`, lower is served first and preempted last",
    "response_format": '`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", '
                       '"json_schema": {"name", "schema", "strict"}}` (enforced whatever `strict` says)',
    "structured_outputs": "one of `json`, `regex`, `choice`, `grammar` (Lark or GBNF), `json_object`",
    "guided_json": "vLLM's older `structured_outputs.json`",
    "guided_regex": "vLLM's older `structured_outputs.regex`",
    "guided_choice": "vLLM's older `structured_outputs.choice`",
    "guided_grammar": "vLLM's older `structured_outputs.grammar`",
    "user": "accepted; kvstrata keeps no per-user state",
    "n": "samples returned; they share one prefill and the prompt's KV blocks",
    "best_of": "samples drawn; the `n` of highest cumulative logprob return, best first; not with `stream`",
    "echo": "completions: the prompt before each completion, and with `logprobs` the prompt's logprobs "
            "first (the first token's null); chat: the reply after the last message when that one is the "
            "assistant's",
    "suffix": "OpenAI: text after the completion (insertion)",
    "logit_bias": "token id (a string) -> bias in [-100, 100] added to its logit; -100 bans it; logprobs "
                  "stay the model's raw ones",
    "allowed_token_ids": "vLLM's: only these tokens may be sampled",
    "bad_words": "vLLM's: words never completed, alone or after a space, whichever way they tokenize",
    "prompt_logprobs": "vLLM's: each prompt token's logprob with this many alternatives, "
                       "`{token id: {logprob, rank, decoded_token}}` per token (the first null); such a "
                       "request computes its whole prompt (no prefix-cache hit)",
    "include_stop_str_in_output": "vLLM's: the stop string ends the text instead of being cut",
    "skip_special_tokens": "vLLM's: false keeps special tokens in the text",
    "spaces_between_special_tokens": "vLLM's: accepted (this model's fast tokenizer places no spaces either way)",
    "truncate_prompt_tokens": "vLLM's: keep only the prompt's last N tokens",
    "return_tokens_as_token_ids": "vLLM's: logprob tokens as `token_id:N`, for tokens that are not valid text",
    "chat_template": "vLLM's: a Jinja chat template for this request instead of the model's",
    "chat_template_kwargs": "vLLM's: more variables for the chat template",
    "add_generation_prompt": "vLLM's: false leaves the assistant's turn unopened",
    "continue_final_message": "vLLM's: the reply continues the last (assistant) message; needs "
                              "`add_generation_prompt: false`",
    "functions": "OpenAI's deprecated `tools`",
    "function_call": "OpenAI's deprecated `tool_choice`",
    "audio": "OpenAI: audio output",
    "modalities": "OpenAI: output modalities",
    "prediction": "OpenAI's predicted output (Prediction, below): speculative decoding drafts from it; the "
                  "output does not change; usage reports `accepted_prediction_tokens` and "
                  "`rejected_prediction_tokens`",
    "kv_transfer_params": "vLLM's: a prefill/decode handoff (KVTransferParams, below), which `kvstrata router "
                          "--pd-disaggregation` adds; an engine refuses one its `--disaggregation-mode` does not take",
    "KVTransferParams.do_remote_decode": "to a prefill engine: answer one token, not streamed, once the prompt's "
                                         "full blocks are in the store; the answer's `kv_transfer_params` say which",
    "KVTransferParams.do_remote_prefill": "to a decode engine: the prompt's KV is in the store (the rest of the "
                                          "object is a prefill engine's answer, sent on as it came)",
    "KVTransferParams.prompt_token_ids": "the prompt as the prefill engine tokenized it; the decode engine serves it",
    "KVTransferParams.block_hashes": "the hashes (hex) of the prompt's full blocks before its last token",
    "KVTransferParams.num_stored_blocks": "how many of them, from the first, the prefill engine's store writes put "
                                          "in the store (the decode engine loads those, recomputes the rest)",
    "KVTransferParams.first_token_id": "the prefill engine's first token (informational: the decode engine "
                                       "computes its own)",
    "KVTransferParams.store_wait_seconds": "how long the prefill engine's answer waited for its store writes",
    "Prediction.type": '`"content"`, the only kind',
    "Prediction.content": 'the text the output is expected to be, or `{"type": "text", "text"}` parts',
    "web_search_options": "OpenAI: web search",
    "reasoning_effort": "OpenAI: a reasoning model's effort",
    "service_tier": "OpenAI: its processing tier",
    "store": "OpenAI: keep the completion on its servers",
    "metadata": "OpenAI: tags of a stored completion",
    "ChatRequest.messages": "the conversation (ChatMessage, below)",
    "max_completion_tokens": "OpenAI's newer `max_tokens`; wins when both are set",
    "ChatRequest.logprobs": "each output token's logprob (the model's own, before penalties and masks)",
    "top_logprobs": "with `logprobs: true`, this many alternatives per token",
    "tools": '`{"type": "function", "function": {"name", "description", "parameters"}}` each; chat only',
    "tool_choice": '`"auto"` (default), `"none"` (tools left out of the prompt), `"required"` or '
                   '`{"type": "function", "function": {"name"}}` (the reply held to the tools\' schemas)',
    "parallel_tool_calls": "false: at most one call per reply",
    "CompletionRequest.prompt": "a string, token ids, or a list of several of either: one choice per prompt "
                                "(times `n`), `index` in order, all queued at once",
    "CompletionRequest.max_tokens": "most tokens to generate (default 16); 0 scores the prompt and generates "
                                    "nothing (with `echo` and `logprobs`, as evaluation harnesses ask)",
    "CompletionRequest.logprobs": "each token's logprob and this many alternatives",
    "role": "`developer` is read as `system`",
    "content": 'text, or `{"type": "text", "text"}` parts; null only for an assistant',
    "name": "accepted; not passed to the chat template",
    "tool_calls": 'an assistant\'s calls, `{"id", "type": "function", "function": {"name", "arguments"}}` each',
    "tool_call_id": "a tool message: the call it answers",
    "include_usage": "a last chunk with `usage` before `[DONE]`",
    "TokenizeRequest.prompt": "text, encoded as `/v1/completions` encodes it (send `prompt` or `messages`)",
    "TokenizeRequest.messages": "chat messages, rendered as `/v1/chat/completions` renders them",
    "add_special_tokens": "with `prompt`: add the tokenizer's special tokens",
    "tokens": "token ids, each within the vocabulary",
}
# The Responses API's request (kvstrata.entrypoints.openai.responses.protocol), where its names mean
# other things than chat's.
FIELDS.update({
    "ResponsesRequest.input": 'the new turn: a string (a user message), or items: messages `{"role", "content"}` '
                              '(`"type": "message"` optional; content text or `input_text` / `output_text` parts), '
                              '`{"type": "function_call", "call_id", "name", "arguments"}` and '
                              '`{"type": "function_call_output", "call_id", "output"}`',
    "ResponsesRequest.instructions": "a system message before the conversation; not carried to the next turn",
    "ResponsesRequest.previous_response_id": "a stored response: its conversation (input and output, not its "
                                             "instructions) comes before `input`; 404 when not stored",
    "ResponsesRequest.store": "keep the response for `previous_response_id` and GET (the last "
                              f"{MAX_STORED_RESPONSES}, in memory)",
    "ResponsesRequest.stream": "server-sent events, `event: <type>` and `data` with a `sequence_number`",
    "ResponsesRequest.stream_options": "`include_obfuscation` (below); only with `stream: true`",
    "ResponsesRequest.max_output_tokens": "most tokens to generate; without it, until the model stops or the "
                                          "context ends; cut short, the response is `incomplete`",
    "ResponsesRequest.temperature": "0 is greedy; null is 1",
    "ResponsesRequest.top_p": "keep the smallest set of tokens whose probabilities reach `top_p`; null is 1",
    "ResponsesRequest.tools": '`{"type": "function", "name", "description", "parameters", "strict"}` each; '
                              "no other kind of tool",
    "ResponsesRequest.tool_choice": '`"auto"` (default), `"none"`, `"required"` or `{"type": "function", "name"}`, '
                                    "as chat's",
    "ResponsesRequest.parallel_tool_calls": "false: at most one call per reply",
    "ResponsesRequest.text": '`{"format": {"type": "text"}}`, `{"format": {"type": "json_object"}}` or '
                             '`{"format": {"type": "json_schema", "name", "schema", "strict"}}` (enforced whatever '
                             '`strict` says)',
    "ResponsesRequest.metadata": "at most 16 string pairs, returned with the response",
    "ResponsesRequest.safety_identifier": "accepted; kvstrata keeps no per-user state",
    "ResponsesRequest.prompt_cache_key": "accepted; the prefix cache finds shared prefixes without a key",
    "ResponsesRequest.reasoning": "OpenAI: a reasoning model's effort and summary",
    "ResponsesRequest.background": "OpenAI: compute the response after the request returns",
    "ResponsesRequest.include": "OpenAI: extra outputs (logprobs, reasoning, tool results)",
    "ResponsesRequest.max_tool_calls": "OpenAI: most built-in tool calls",
    "ResponsesRequest.top_logprobs": "OpenAI: alternatives per output token",
    "ResponsesRequest.service_tier": "OpenAI: its processing tier",
    "ResponsesRequest.conversation": "OpenAI: a stored conversation object",
    "ResponsesRequest.prompt": "OpenAI: a stored prompt template",
    "ResponsesRequest.truncation": "OpenAI: drop the conversation's oldest items to fit the context",
    "include_obfuscation": "accepted; kvstrata pads no deltas",
})
EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens", "priority",
              "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
UNUSED = {"user", "ChatMessage.name", "safety_identifier", "prompt_cache_key", "include_obfuscation"}

BEGIN, END = "<!-- reference:{}:begin -->", "<!-- reference:{}:end -->"


def _cell(text: str) -> str:
    """A table cell: pipes escaped, and stars outside `code` (a lone * would start emphasis)."""
    pieces = text.replace("|", "\\|").replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("*", "\\*") for i, p in enumerate(pieces))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


# ---- the serving API -----------------------------------------------------------------------------
def _type(hint: Any) -> str:
    """A JSON reader's name for a field's type: `string`, `integer[]`, `"a" or "b"`, `ChatMessage[]`..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type(a) for a in args if a is not type(None))
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin is list:
        return f"{_type(args[0])}[]"
    if origin is dict or hint is dict:
        return "object"
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return hint.__name__
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    return names.get(hint, "any")


def _bounds(metadata: list[Any]) -> str:
    """`Field(ge=0, le=2)` -> `[0, 2]`; `min_length=1` -> `at least 1`."""
    low = next((f"[{m.ge}" for m in metadata if hasattr(m, "ge")), None) or \
        next((f"({m.gt}" for m in metadata if hasattr(m, "gt")), "")
    high = next((f"{m.le}]" for m in metadata if hasattr(m, "le")), None) or \
        next((f"{m.lt})" for m in metadata if hasattr(m, "lt")), "")
    if low or high:
        return f"{low or '(-inf'}, {high or 'inf)'}"
    return next((f"at least {m.min_length}" for m in metadata if hasattr(m, "min_length")), "")


def _describe(model: type[BaseModel], name: str) -> str:
    text = FIELDS.get(f"{model.__name__}.{name}", FIELDS.get(name))
    if text is None:
        raise KeyError(f"{model.__name__}.{name} has no entry in kvstrata.entrypoints.cli.reference.FIELDS")
    return text


def _status(model: type[BaseModel], name: str) -> str:
    refused = REFUSED.get(model, {})
    if name in refused:
        return f"refused (400) unless `{json.dumps(refused[name])}`"
    if name in UNUSED or f"{model.__name__}.{name}" in UNUSED:
        return "accepted, unused"
    return "supported (vLLM)" if name in EXTENSIONS else "supported"


def body_table(model: type[BaseModel]) -> list[str]:
    """Every field a body declares itself (a subclass's table leaves out what its base declares)."""
    inherited = {name for base in model.__mro__[1:] for name in getattr(base, "model_fields", {})}
    rows = []
    for name, field in model.model_fields.items():
        if name in inherited:
            continue
        default = "required" if field.is_required() else f"`{json.dumps(field.get_default())}`"
        kind = _type(field.annotation) + (f" {bound}" if (bound := _bounds(field.metadata)) else "")
        rows.append((f"`{name}`", kind, default, _status(model, name), _describe(model, name)))
    return _table(("field", "type", "default", "status", "what it does"), rows)


def render_serving_api() -> dict[str, str]:
    endpoints = []
    for route in [*router.routes, *adapter_router.routes, *responses_router().routes]:
        body = next((p.field_info.annotation.__name__ for p in route.dependant.body_params), "")
        query = ", ".join(f"`{q.name}`" for q in route.dependant.query_params)
        methods = " ".join(sorted(route.methods))
        what = ENDPOINTS.get(f"{methods} {route.path}", ENDPOINTS.get(route.path))
        if what is None:
            raise KeyError(f"{route.path} has no entry in kvstrata.entrypoints.cli.reference.ENDPOINTS")
        endpoints.append((methods, f"`{route.path}`", body and f"[{body}](#{body.lower()})", query, what))
    bodies = []
    for model in BODIES:
        base = next((b.__name__ for b in model.__bases__ if getattr(b, "model_fields", None)), None)
        bodies += [f"### {model.__name__}", ""]
        if base:
            bodies += [f"Every field of [{base}](#{base.lower()}), and:", ""]
        bodies += [*body_table(model), ""]
    return {"endpoints": "\n".join(_table(("method", "path", "body", "query", "what it does"), endpoints)),
            "bodies": "\n".join(bodies).rstrip()}


# ---- the command line ----------------------------------------------------------------------------
def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"
    if isinstance(action, argparse.BooleanOptionalAction):     # the form that holds when neither is given
        return f"`{action.option_strings[0 if action.default else 1]}`"
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._AppendAction):
        return ""
    if action.type is parse_size and isinstance(action.default, int):
        return f"`{format_size(action.default)}`"
    return f"`{action.default}`" if action.default != "" else '`""`'


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each sub-command, in the order they were added."""
    subs = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if subs is None:
        return []
    return [(choice.dest, choice.help or "", subs.choices[choice.dest]) for choice in subs._choices_actions]


def command_section(path: str, summary: str, parser: argparse.ArgumentParser, seen: dict[tuple, str],
                    level: int = 2) -> list[str]:
    """One command's flags, group by group; `-h` and `--log-level` (on every command) left out, and a
    group already rendered for another command (`seen`: its rows -> that command) named, not repeated."""
    lines = [f"{'#' * level} kvstrata {path}", "", f"{summary[:1].upper()}{summary[1:]}.", ""]
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if isinstance(action, argparse._SubParsersAction) or action.dest in ("help", "log_level"):
                continue
            flag = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
            choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
            required = "required; " if action.required else ""
            rows.append((flag, _default(action), choices, required + (action.help or "")))
        title = f"{group.title[:1].upper()}{group.title[1:]}"
        if tuple(rows) in seen:
            other = seen[tuple(rows)]
            lines += [f"{title}: as [kvstrata {other}](#kvstrata-{other.replace(' ', '-')}).", ""]
        elif rows:
            seen[tuple(rows)] = path
            lines += [f"{title}:", "", *_table(("flag", "default", "choices", "help"), rows), ""]
    for name, help_text, sub in _subcommands(parser):
        lines += command_section(f"{path} {name}", help_text, sub, seen, level + 1)
    return lines


def render_configuration(parser: argparse.ArgumentParser | None = None) -> dict[str, str]:
    parser = parser or build_parser()
    lines: list[str] = []
    seen: dict[tuple, str] = {}
    for name, help_text, sub in _subcommands(parser):
        lines += command_section(name, help_text, sub, seen)
    return {"commands": "\n".join(lines).rstrip()}


# ---- the documents -------------------------------------------------------------------------------
def update(text: str, parts: dict[str, str]) -> str:
    """`text` with each generated part replaced by its new rendering; the prose is kept."""
    for name, body in parts.items():
        begin, end = BEGIN.format(name), END.format(name)
        head, found, rest = text.partition(begin)
        _, found_end, tail = rest.partition(end)
        if not (found and found_end):
            raise ValueError(f"the markers {begin} ... {end} are missing")
        text = f"{head}{begin}\n{body}\n{end}{tail}"
    return text


def documents(docs: Path) -> dict[Path, dict[str, str]]:
    return {docs / "serving-api.md": render_serving_api(), docs / "configuration.md": render_configuration()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rewrite the generated parts of the reference docs")
    parser.add_argument("--docs", type=Path, default=Path("docs"), help="the docs folder (default: docs)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a document is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, parts in documents(args.docs).items():
        old = path.read_text()
        new = update(old, parts)
        if new != old:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    verb = "stale (run `make docs`)" if args.check else "rewritten"
    print("\n".join(f"{path}: {verb}" for path in stale) or "docs are up to date")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
