"""The request bodies of the OpenAI-compatible API (pydantic), with the checks a body can make alone.

Parameters the OpenAI API defines but kvstrata does not implement are refused with 400, never
silently ignored (see UNSUPPORTED). Fields nobody defines are accepted and ignored, with one log line
naming them (vLLM's behaviour: clients add fields of their own).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvstrata.core.sampling_params import MAX_SAMPLES, GrammarSpec, SamplingParams
from kvstrata.entrypoints.openai.errors import ApiError
from kvstrata.structured.grammar import compile_grammar, spec_from_request

MAX_STOP = 16
MAX_BAD_WORDS = 1024     # each tokenized twice (alone and after a space) before the request is queued
MAX_BAD_WORD_CHARS = 256
COMPLETION_MAX_TOKENS = 16      # /v1/completions without max_tokens, as OpenAI and vLLM

# Defined by the OpenAI API, not implemented here: a request that sets one to a non-default value gets 400.
UNSUPPORTED = {
    "suffix": None,
    "functions": None, "function_call": None, "audio": None, "modalities": None,
    "web_search_options": None, "reasoning_effort": None, "service_tier": None, "store": None,
    "metadata": None,
}


class OpenAIModel(BaseModel):
    """A request body: fields it does not define are kept aside (`ignored_fields`), not refused."""

    model_config = ConfigDict(extra="allow")

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """Names of the fields sent that this body does not define, nested bodies' included."""
        names = [prefix + name for name in (self.model_extra or {})]
        for name in type(self).model_fields:
            value = getattr(self, name)
            for index, item in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(item, OpenAIModel):
                    where = f"{name}[{index}]." if isinstance(value, list) else f"{name}."
                    names += item.ignored_fields(prefix + where)
        return names


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class Prediction(OpenAIModel):
    """OpenAI predicted outputs: text the output is expected to be (mostly), where speculative decoding
    takes its drafts from."""

    type: Literal["content"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if not all(part.get("type") == "text" and isinstance(part.get("text"), str) for part in self.content):
            raise ApiError(400, "prediction: only text content parts are supported", param="prediction")
        return "".join(part["text"] for part in self.content)


class KVTransferParams(OpenAIModel):
    """The prefill/decode handoff (vLLM's field name; docs/design/disaggregation.md), which `kvstrata
    router --pd-disaggregation` adds: to a prefill engine `{"do_remote_decode": true}`; to a decode
    engine the prefill engine's answer's `kv_transfer_params`, as it came."""

    do_remote_decode: bool = False            # prefill: compute the prompt, hand its KV over through the store
    do_remote_prefill: bool = False           # decode: the prompt's KV is in the store
    prompt_token_ids: list[int] | None = None     # decode: the prompt as the prefill engine tokenized it
    block_hashes: list[str] | None = None     # decode: the full prompt blocks' hashes (hex), in order
    num_stored_blocks: int = Field(default=0, ge=0)   # decode: how many of them, from the first, reached the store
    first_token_id: int | None = None         # the prefill engine's first token (greedy: the decode's own first)
    store_wait_seconds: float = 0.0           # how long the prefill engine's answer waited for its store writes

    @model_validator(mode="after")
    def _one_role(self) -> KVTransferParams:
        if self.do_remote_decode == self.do_remote_prefill:
            raise ValueError("kv_transfer_params needs exactly one of do_remote_decode, do_remote_prefill")
        if self.do_remote_prefill and not self.prompt_token_ids:
            raise ValueError("kv_transfer_params with do_remote_prefill needs the prompt_token_ids")
        return self


class SamplingBody(OpenAIModel):
    """Fields shared by chat and completions (OpenAI names, plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)               # extension (vLLM); 0 = off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # extension
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)  # extension
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None           # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                          # extension
    min_tokens: int = Field(default=0, ge=0)          # extension
    priority: int = 0                                 # extension: lower is served first (policy=priority)
    response_format: dict[str, Any] | None = None     # text, json_object, json_schema (structured/grammar.py)
    structured_outputs: dict[str, Any] | None = None  # extension (vLLM): json, regex, choice, grammar, json_object
    guided_json: dict[str, Any] | str | None = None   # extension (vLLM before 0.12), as the four below
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None                           # accepted; kvstrata keeps no per-user state
    n: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)          # None: 1
    best_of: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)    # sampled; the n best return
    echo: bool = False                                # the prompt (its logprobs too) before the completion
    logit_bias: dict[str, float] | None = None        # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None        # extension (vLLM)
    bad_words: list[str] | None = None                # extension (vLLM)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)     # extension (vLLM)
    include_stop_str_in_output: bool = False          # extension (vLLM)
    skip_special_tokens: bool = True                  # extension (vLLM)
    spaces_between_special_tokens: bool = True        # extension (vLLM)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)     # extension (vLLM): keep the last N
    return_tokens_as_token_ids: bool = False          # extension (vLLM): logprob tokens as "token_id:N"
    kv_transfer_params: KVTransferParams | None = None    # extension (vLLM): prefill/decode disaggregation
    # Defined by OpenAI, refused unless default (see UNSUPPORTED).
    suffix: str | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Prediction | None = None              # drafts for speculative decoding (see Prediction)
    web_search_options: Any = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop must be at most {MAX_STOP} non-empty strings")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value):
        if value is not None and (len(value) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in value)):
            raise ValueError(f"bad_words must be at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} "
                             "characters")
        return value

    def refuse_unsupported(self) -> None:
        for name, default in UNSUPPORTED.items():
            value = getattr(self, name, default)
            if value is None or value == default:
                continue
            raise ApiError(400, f"'{name}' is not supported by kvstrata", param=name)

    def structured(self) -> GrammarSpec | None:
        """The grammar the output must match, from whichever field asked for one."""
        guided = {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                         "guided_grammar")}
        return spec_from_request(self.response_format, self.structured_outputs, guided)

    def sampling(self, max_tokens: int | None, logprobs: int | None,
                 structured: GrammarSpec | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        """max_tokens None: up to the context length, resolved once the prompt is tokenized. The grammar
        is compiled here, off the engine thread (the engine finds it cached)."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        try:
            bias = {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        except ValueError as exc:
            raise ApiError(400, "logit_bias: keys must be token ids", param="logit_bias") from exc
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=tuple(stops),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, logprobs=logprobs,
            n=self.n or 1, best_of=self.best_of, structured=structured, logit_bias=bias or None,
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            bad_words=tuple(self.bad_words or ()), prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        ).validate()
        if structured is not None:
            compile_grammar(structured)
        return params


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None      # None only for assistant (as OpenAI allows)
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None         # assistant: the calls it made (structured/tool_calls.py)
    tool_call_id: str | None = None                        # tool: the call this is the result of

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_calls is not None and (self.role != "assistant" or not all(
                isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments"), str) for c in self.tool_calls)):
            raise ValueError('tool_calls belong to assistant messages, each {"id", "type": "function", '
                             '"function": {"name", "arguments"}}')
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None                  # extension (vLLM): this request's own Jinja template
    chat_template_kwargs: dict[str, Any] | None = None    # extension (vLLM): more template variables
    add_generation_prompt: bool = True                # extension (vLLM)
    continue_final_message: bool = False              # extension (vLLM): the reply continues the last message

    @model_validator(mode="after")
    def _template_options(self) -> ChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message continues an assistant message: make it the last one")
        return self


class CompletionRequest(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)     # 0: score the prompt (with echo), generate nothing
    logprobs: int | None = Field(default=None, ge=0, le=20)


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a prompt (encoded as /v1/completions encodes it) or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True                # vLLM's default for a prompt, as /v1/completions encodes it


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRARequest(OpenAIModel):
    """vLLM's /v1/load_lora_adapter: a PEFT folder to serve as `lora_name`; again under a loaded name
    only with `load_inplace` (its new requests then run the new weights, never their cached blocks)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRARequest(OpenAIModel):
    lora_name: str = Field(min_length=1)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            item["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out
