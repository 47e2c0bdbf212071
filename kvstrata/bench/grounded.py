"""Input-grounded workloads: chat requests whose replies quote or edit their prompt, where
speculative decoding from the request's own text (n-gram prompt lookup) and OpenAI predicted
outputs pay; and a chat workload with little to quote, where they must cost nothing.

    code-edit            rename an identifier in a source file, reply with the whole file
    code-edit-predicted  the same, the request carrying the original file as its `prediction`
    quote-summary        summarise a passage, quoting its key sentences word for word
    chat                 open questions (a story, an explanation): little of the prompt comes back

Prompts are the files and passages of `texts.py` through the model's chat template, as token ids
(`OfflineCase`), so a peer runs the very same ids. Variants are enumerated in a fixed order and
dealt out without repeats until they run out (then they wrap), so each repeat of a case gets
prompts of its own and finds nothing of the previous one in a prefix cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.bench.cases import OfflineCase
from kvstrata.bench.texts import CHAT_QUESTIONS, PASSAGES, SOURCES

EDIT_ASKS = ("Rename `{old}` to `{new}` everywhere in this file. Reply with the whole file, changed, and nothing else.",
             "In the file below, `{old}` should be called `{new}`. Give me the complete updated file.")
SUMMARY_ASKS = ("Summarise this passage in a few sentences, quoting its key sentences word for word.",
                "What does this passage say? Answer with short quotes from it.",
                "Give the main points of this text, each with a sentence quoted exactly from it.")


@dataclass(frozen=True)
class GroundedPrompt:
    message: str                  # the user's message
    prediction: str | None = None  # OpenAI predicted output: the text the reply is expected to be


def _code_edits(predicted: bool) -> list[GroundedPrompt]:
    """Every (ask, rename) of every file, the files taking turns (neighbours in the order differ most)."""
    prompts = []
    for ask, index in itertools.product(EDIT_ASKS, range(max(len(s.renames) for s in SOURCES))):
        for source in (s for s in SOURCES if index < len(s.renames)):
            old, new = source.renames[index]
            fenced = f"```{source.language}\n{source.text}```"
            prompts.append(GroundedPrompt(f"{ask.format(old=old, new=new)}\n\n{fenced}", fenced if predicted else None))
    return prompts


def _summaries() -> list[GroundedPrompt]:
    return [GroundedPrompt(f"{ask}\n\n{passage.title}\n\n{passage.text}")
            for ask, passage in itertools.product(SUMMARY_ASKS, PASSAGES)]


def _chats() -> list[GroundedPrompt]:
    return [GroundedPrompt(question) for question in CHAT_QUESTIONS]


GROUNDED: dict[str, Callable[[], list[GroundedPrompt]]] = {
    "code-edit": lambda: _code_edits(predicted=False),
    "code-edit-predicted": lambda: _code_edits(predicted=True),
    "quote-summary": _summaries,
    "chat": _chats,
}


def grounded_prompts(kind: str) -> list[GroundedPrompt]:
    """Every variant of a workload, in a fixed order."""
    if kind not in GROUNDED:
        raise ValueError(f"workload must be one of {', '.join(GROUNDED)}, not {kind!r}")
    return GROUNDED[kind]()


def grounded_case(kind: str, num_prompts: int, repeats: int, output_len: int,
                  chat_prompt: Callable[[list[dict]], list[int]], encode: Callable[[str], list[int]],
                  name: str | None = None) -> OfflineCase:
    """`repeats` x `num_prompts` prompts of workload `kind` as token ids (`chat_prompt` renders the
    messages with the model's template, `encode` tokenizes a prediction), dealt in order."""
    variants = grounded_prompts(kind)
    dealt = [variants[i % len(variants)] for i in range(repeats * num_prompts)]
    rows = [dealt[r * num_prompts:(r + 1) * num_prompts] for r in range(repeats)]
    ids = [[chat_prompt([{"role": "user", "content": p.message}]) for p in row] for row in rows]
    predicted = any(p.prediction for p in variants)
    predictions = [[encode(p.prediction or "") for p in row] for row in rows] if predicted else None
    return OfflineCase(name or f"{kind} x{num_prompts}", output_len, ids, predictions)
