"""Incremental detokenization: text deltas that never split a character, and stop strings.

Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding such a prefix gives
U+FFFD. So text is only released once decoding the newest tokens no longer ends in U+FFFD, and
each new piece is the difference between decoding a short window with and without the newest
tokens (a few prompt tokens seed the window, so leading spaces decode as they would in context).

With stop strings, the last `max(len(stop)) - 1` characters are held back until the request ends:
they may be the start of a stop string, and text once streamed cannot be taken back. The text ends
before the stop string, or after it with `include_stop`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self._decode_options = {"skip_special_tokens": skip_special_tokens,
                                "spaces_between_special_tokens": spaces_between_special_tokens}
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""              # output text so far, cut at a stop string once one is found
        self.emitted = 0            # characters of `text` already handed out
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, **self._decode_options)

    def add(self, token_id: int) -> str | None:
        """Take one output token; return the stop string it completed, if any (text is cut before it). A model
        without a tokenizer (token ids in and out) has no text: nothing to decode, no stop string."""
        self.tokens.append(token_id)
        if self.tokenizer is None:
            return None
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None             # an incomplete character (or nothing visible) so far
        before = len(self.text)
        self.text += full_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return self._find_stop(max(0, before - self.hold))

    def _find_stop(self, search_from: int) -> str | None:
        best = None
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        self.text = self.text[:best[0] + (len(best[1]) if self.include_stop else 0)]
        return best[1]

    def delta(self, final: bool) -> str:
        """Text not yet handed out; while running, minus what could still be a stop string's start."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
