"""Latency bookkeeping for one request: reported to metrics and logged (one line) when it ends, however it ends."""

from __future__ import annotations

import logging
import time

from kvstrata.core.outputs import RequestOutput
from kvstrata.entrypoints.openai.state import ServerState

# One line per request however it ends, and one per request refused (api_server): the request log.
request_log = logging.getLogger("kvstrata.entrypoints.openai.requests")


class RequestTracker:
    """Latency bookkeeping for one request (all its samples), reported to metrics and logged (one
    INFO line) when it ends, however it ends."""

    def __init__(self, state: ServerState, arrival: float, request_id: str, num_samples: int = 1):
        self.state, self.arrival, self.request_id = state, arrival, request_id
        self.arrival_wall = int(time.time())
        self.first: float | None = None
        self.last: RequestOutput | None = None
        self.latest: dict[int, RequestOutput] = {}       # each sample's latest output
        self.num_samples = num_samples

    def seen(self, out: RequestOutput) -> None:
        if out.new_token_ids and self.first is None:
            self.first = time.monotonic()
        self.last = self.latest[out.index] = out

    @property
    def finished(self) -> bool:
        return len(self.latest) == self.num_samples and all(out.finished for out in self.latest.values())

    def done(self) -> None:
        last, end = self.last, time.monotonic()
        outcome = (last.finish_reason or "abort") if last and self.finished else "abort"
        num_output = sum(out.num_output_tokens for out in self.latest.values())
        self.state.metrics.observe(outcome, self.arrival, self.first, end, num_output,
                                   last.num_prompt_tokens if last else None,
                                   last.first_scheduled_time if last else None)
        ttft = f"{self.first - self.arrival:.3f}s" if self.first is not None else "-"
        for out in self.latest.values():
            if out.timeline is not None:
                out.timeline.received, out.timeline.first_sent, out.timeline.last_sent = self.arrival, self.first, end
                key = self.request_id if self.num_samples == 1 else f"{self.request_id}/{out.index}"
                self.state.timelines.add(key, out.timeline)
        if self.state.tracing is not None:      # never raises
            self.state.tracing.record(self.request_id, self.state.model_name,
                                      [self.latest[i] for i in sorted(self.latest)], self.arrival, self.first, end)
        request_log.info("%s: %d prompt tokens (%d cached), %d output tokens, ttft %s, %.3fs, finish %s",
                    self.request_id, last.num_prompt_tokens if last else 0, last.num_cached_tokens if last else 0,
                    num_output, ttft, end - self.arrival, outcome)
