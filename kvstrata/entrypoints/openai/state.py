"""What the HTTP handlers share: the engine's front door and what it published once at build time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.engine.async_engine import AsyncLLMEngine
from kvstrata.engine.prompts import PromptEncoder
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
    api_key: str | None
    max_queue: int
    metrics: ServerMetrics
    prompts: PromptEncoder
    timelines: TimelineStore = field(default_factory=TimelineStore)
    tracing: RequestTracing | None = None       # OpenTelemetry traces of finished requests (default: off)
    disaggregation_mode: str = "both"           # the handoffs it takes (kvstrata.entrypoints.openai.handoff)
    created: int = field(default_factory=lambda: int(time.time()))

    def token_text(self, token_id: int) -> str:
        return self.prompts.decode([token_id])
