"""What callers ask of the engine thread, as typed values on its command queue (kvstrata.engine.async_engine).

A caller's thread builds a command and puts it on the queue; the engine thread takes it between steps and is the
only one to act on it. Each carries what the engine thread answers through (a future on the caller's event loop,
and for a request the queue its outputs stream into).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.prompts import Prompt, Tokenized


@dataclass(frozen=True)
class AddRequest:
    """Queue a request (LLMEngine.add_request's arguments); `admitted` settles once it is queued or refused, and
    its outputs go to `outputs` on `loop`."""

    prompt: Prompt | Tokenized
    params: SamplingParams | None
    request_id: str
    priority: int
    prediction: str | None
    hand_off: bool
    lora: str | None
    admitted: asyncio.Future
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


@dataclass(frozen=True)
class Abort:
    """End a request (a family's samples too) in any state and release what it holds."""

    request_id: str


@dataclass(frozen=True)
class AbortAll:
    """End every request with a stream (shutdown)."""


@dataclass(frozen=True)
class Call:
    """Run `fn(engine)` between steps (installing an adapter read elsewhere, say); its result or error settles
    `done` on `loop`."""

    fn: Callable
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop


Command = AddRequest | Abort | AbortAll | Call
