"""Prompts to token ids: text, token ids, or chat messages through the model's own template.

A `PromptEncoder` holds one tokenizer and is used from one thread: the engine thread has its own,
and the HTTP server a copy (`copy()`), because a Hugging Face tokenizer object is not meant to be
shared between threads (its Rust core borrows itself mutably to set truncation and padding).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.core.errors import RequestRejected
from kvstrata.structured.tool_calls import render_chat


@dataclass(frozen=True)
class ChatPrompt:
    """Messages to render with the model's chat template (in the engine thread, with the tokenizer)."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()     # OpenAI function tools, rendered for the model (kvstrata.structured)
    template: str | None = None                # the request's own template instead of the model's
    template_kwargs: tuple[tuple[str, Any], ...] = ()     # more variables for the template
    add_generation_prompt: bool = True         # open the assistant's turn
    continue_final_message: bool = False       # or continue the last message, left open


@dataclass(frozen=True)
class Tokenized:
    """A request's text already turned into ids (`PromptEncoder.tokenize`): the HTTP server does it on
    worker threads, so a long prompt or ten thousand bad words stall neither its event loop nor the
    engine thread's steps."""

    prompt: tuple[int, ...]
    bad_words: tuple[tuple[int, ...], ...] = ()     # each bad word's spellings (`bad_word_sequences`)
    prediction: tuple[int, ...] = ()                # OpenAI predicted outputs, as ids


Prompt = str | Sequence[int] | ChatPrompt


class PromptEncoder:
    """The model's tokenizer and chat template, for one thread."""

    def __init__(self, tokenizer: Any, chat_template: str | None, model_name: str):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_name = model_name

    def copy(self) -> PromptEncoder:
        """An encoder with a tokenizer of its own, for another thread."""
        return PromptEncoder(copy.deepcopy(self.tokenizer), self.chat_template, self.model_name)

    def tokenize(self, prompt: Prompt, bad_words: Sequence[str] = (),
                 prediction: str | Sequence[int] | None = None) -> Tokenized:
        """Everything of a request that needs the tokenizer, in one call."""
        return Tokenized(tuple(self.encode(prompt)), self.bad_word_sequences(bad_words),
                         tuple(self.encode(prediction)) if prediction else ())

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, ChatPrompt):
            return self.chat_prompt(prompt.messages, prompt.tools, prompt)
        if isinstance(prompt, str):     # the tokenizer's special tokens, as vLLM's completions add them: a
            return self.tokenizer.encode(prompt, add_special_tokens=True)     # Gemma's <bos> (SmolLM2 has none)
        return [int(t) for t in prompt]

    def chat_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = (),
                    options: ChatPrompt | None = None) -> list[int]:
        """Token ids of a chat rendered with the model's own template (or `options.template`), ready for
        the reply; `options` carries the request's other template settings."""
        options = options or ChatPrompt(())
        template = options.template or self.chat_template
        if not template:
            raise ValueError(f"the model {self.model_name} has no chat template; use a completion instead")
        try:
            text = render_chat(self.tokenizer, template, messages, tools, options.add_generation_prompt,
                               options.continue_final_message, dict(options.template_kwargs))
        except Exception as exc:        # the template's own checks (role order, missing fields)
            raise RequestRejected(f"the chat template rejected these messages: {exc}", "prompt") from exc
        return self.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def bad_word_sequences(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids, alone and after a space (how it tokenizes mid-sentence), as vLLM does."""
        sequences = []
        for word in words:
            for spelling in dict.fromkeys((word, word if word.startswith(" ") else " " + word)):
                ids = tuple(self.tokenizer.encode(spelling, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return tuple(sequences)
