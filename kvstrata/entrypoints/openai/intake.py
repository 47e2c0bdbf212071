"""The server's work on a request before the engine sees it, off the event loop: tokenizing (prompt,
bad words, prediction), chat templates, grammar compilation and detokenizing run on a few worker
threads (at a lower CPU priority than the steps), so a 10 MB prompt delays its own answer and nobody
else's (`/health` included). Hugging Face's fast tokenizer releases the GIL while it encodes, so the
loop keeps serving meanwhile; one tokenizer object is not safe under concurrent calls, so each worker
has its own copy.

Before any of that work, a text certainly longer than the context is refused from its length alone:
no token stands for more characters than the vocabulary's longest entry, so a text of more characters
than max_model_len times that cannot fit (`Intake.check_length`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvstrata.engine.prompts import ChatPrompt, Prompt, PromptEncoder, Tokenized
from kvstrata.entrypoints.openai.errors import ApiError

T = TypeVar("T")
WORKERS = 4        # threads for the expensive intake work; a request waits for one only while all are busy


class Intake:
    """Worker threads with a PromptEncoder each, and the length bound checked before using them."""

    def __init__(self, prompts: PromptEncoder, max_model_len: int, workers: int = WORKERS):
        self._source = prompts.copy()       # the workers' copies are made from this one, nobody else's
        self._copying = threading.Lock()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvstrata-intake", initializer=_yield_to_steps)
        self.max_model_len = max_model_len
        longest = _longest_token(prompts.tokenizer)
        self.max_text_chars = None if longest is None else max_model_len * longest

    async def run(self, work: Callable[[PromptEncoder], T]) -> T:
        """`work(encoder)` on a worker thread, with that thread's own encoder."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: work(self._encoder()))

    async def tokenize(self, prompt: Prompt, bad_words: Sequence[str] = (), prediction: str | None = None,
                       param: str = "prompt", truncated: bool = False) -> Tokenized:
        """A request's ids, after its texts passed the length bound (400 naming `param` if not; a prompt
        the request asks to truncate may be longer: the body limit bounds it)."""
        if not truncated:
            self.check_length(prompt, param)
        if prediction is not None:
            self.check_length(prediction, "prediction")
        return await self.run(lambda encoder: encoder.tokenize(prompt, bad_words, prediction))

    def check_length(self, prompt: Prompt, param: str) -> None:
        """400 for text that cannot fit in the context whatever it tokenizes to; cheap (no tokenizing)."""
        if isinstance(prompt, Sequence) and not isinstance(prompt, str):
            if len(prompt) > self.max_model_len:
                raise ApiError(400, f"{len(prompt)} prompt tokens are more than the context's {self.max_model_len}",
                               param=param)
            return
        chars = _text_chars(prompt)
        if self.max_text_chars is not None and chars > self.max_text_chars:
            raise ApiError(400, f"the text is longer than the context can hold: {chars} characters are more than "
                                f"{self.max_model_len} tokens of this vocabulary can cover", param=param)

    def _encoder(self) -> PromptEncoder:
        encoder = getattr(self._local, "encoder", None)
        if encoder is None:
            with self._copying:
                encoder = self._local.encoder = self._source.copy()
        return encoder


def _yield_to_steps() -> None:
    """A worker runs at a lower CPU priority (nice +10, this thread alone: Linux) than the engine's steps:
    on a machine whose cores the steps keep busy, a long prompt's tokenizing takes what they leave,
    not a share of every stream's next token. Short prompts take microseconds either way."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _longest_token(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for (an upper bound): the UTF-8 length of the
    vocabulary's longest entry (a byte-level BPE entry spells each byte as one 1- or 2-byte character,
    a SentencePiece one its text with '▁' for a space), times 4 where a normalizer may shorten the text
    before it is split (NFKC, composed accents). None: a model without a tokenizer (it takes no text)."""
    if tokenizer is None:
        return None
    longest = max(len(token.encode()) for token in tokenizer.get_vocab())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalized = backend is None or backend.normalizer is not None
    return longest * (4 if normalized else 1)


def _text_chars(prompt: Prompt | str) -> int:
    """Characters of text a prompt certainly sends to the tokenizer: a string's; a chat's message
    contents but the assistant's, stripped (a template may trim them, and may rewrite an assistant's
    earlier turns, as Qwen 3's drops their reasoning); token ids have none."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, ChatPrompt):
        return sum(_content_chars(message.get("content")) for message in prompt.messages
                   if message.get("role") != "assistant")
    return 0


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content.strip())
    if isinstance(content, list):
        return sum(len(part["text"].strip()) for part in content
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0
