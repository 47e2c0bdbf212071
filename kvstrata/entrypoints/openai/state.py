"""What the HTTP handlers share: the engine's front door and what it published once at build time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.engine.async_engine import AsyncLLMEngine
from kvstrata.engine.prompts import PromptEncoder
from kvstrata.entrypoints.openai.errors import ApiError
from kvstrata.entrypoints.openai.intake import Intake
from kvstrata.entrypoints.openai.metrics import ServerMetrics
from kvstrata.entrypoints.openai.timelines import TimelineStore

if TYPE_CHECKING:       # only `--otlp-traces-endpoint` imports it (and OpenTelemetry)
    from kvstrata.entrypoints.openai.tracing import RequestTracing


@dataclass
class ServerState:
    """The handlers' view of one engine: they talk to it through `engine` (generate, abort) and read
    only what its thread publishes (`engine.snapshot`, `engine.kv_events`); `prompts` is the server's
    own tokenizer, never the engine thread's."""

    engine: AsyncLLMEngine
    model_name: str
    max_model_len: int
    vocab_size: int
    max_queue: int
    metrics: ServerMetrics
    prompts: PromptEncoder                      # for the event loop's own small decodes (a token's text)
    intake: Intake                              # tokenizing and the like, on worker threads
    timelines: TimelineStore = field(default_factory=TimelineStore)
    tracing: RequestTracing | None = None       # OpenTelemetry traces of finished requests (default: off)
    disaggregation_mode: str = "both"           # the handoffs it takes (kvstrata.entrypoints.openai.handoff)
    created: int = field(default_factory=lambda: int(time.time()))
    reserved: int = 0       # places in the queue taken by requests not yet in the engine's count

    @contextmanager
    def queue_places(self, count: int) -> Iterator[None]:
        """Hold `count` places in the queue (--max-queue) while a request's prompts are prepared and
        handed to the engine, whose own count holds them from their first output on: the check and the
        taking are one step on the event loop, so a burst gets exactly the places there are; 503 with
        Retry-After for the rest, before any work is done for them."""
        if self.engine.num_unfinished + self.reserved + count > self.max_queue:
            raise ApiError(503, f"the server is at capacity ({self.max_queue} requests in flight); retry later",
                           code="server_overloaded", headers={"Retry-After": "1"})
        self.reserved += count
        try:
            yield
        finally:
            self.reserved -= count

    def token_text(self, token_id: int) -> str:
        return self.prompts.decode([token_id])
