"""Where one request's time went: the engine's record of it, step by step, and its breakdown.

The engine thread appends a `Span` for every step that computed some of the request's tokens (a
prefill chunk or a decode), and for the stretches it spent loading lower-tier blocks or preempted;
the HTTP side adds when it received the request and sent the first and the last bytes. The rest of a request's life is
waiting: for admission (queued), and between steps while running (the engine busy with something
else: other requests' admissions, store work, taking commands, idling).

    received ─ before engine ─ arrival ─ queued ─┬─ load ─┬─ prefill ── gap ── prefill ─┬─ decode ─ gap ─ decode ... ─ end
                      first scheduled                        first token

Times are the engine's `time.monotonic()` (the server's clock: one process), in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPAN_KINDS = ("prefill", "decode", "load", "preempted")


@dataclass(frozen=True, slots=True)
class Span:
    """One stretch of a request's life: a step that computed `tokens` of it (among `step_tokens` in
    the step, `step_prefill_tokens` of them prefill), a load, or a preemption."""

    kind: str
    start: float
    end: float
    tokens: int = 0
    step_tokens: int = 0
    step_prefill_tokens: int = 0

    def as_list(self) -> list:
        return [self.kind, self.start, self.end, self.tokens, self.step_tokens, self.step_prefill_tokens]


@dataclass
class RequestTimeline:
    """A request's spans in order, from its arrival; filled by the engine thread until the request
    finishes, then handed over (with the last output) and never touched by the engine again."""

    arrival: float
    spans: list[Span] = field(default_factory=list)
    finished: float | None = None
    received: float | None = None        # the HTTP side: the request came in (tokenized after, by the engine)
    first_sent: float | None = None      # the HTTP side: first output on the wire
    last_sent: float | None = None       # the HTTP side: the response's end

    def add(self, span: Span) -> None:
        assert span.kind in SPAN_KINDS and span.end >= span.start, span
        self.spans.append(span)

    def as_dict(self) -> dict:
        return {"arrival": self.arrival, "finished": self.finished, "received": self.received,
                "first_sent": self.first_sent, "last_sent": self.last_sent,
                "spans": [span.as_list() for span in self.spans]}

    @classmethod
    def from_dict(cls, data: dict) -> RequestTimeline:
        return cls(data["arrival"], [Span(*span) for span in data["spans"]], data.get("finished"),
                   data.get("received"), data.get("first_sent"), data.get("last_sent"))

    def breakdown(self) -> dict[str, float]:
        """Seconds by where they went: before the engine (its command queue, tokenizing), queued (to the
        first span), load, preempted, prefill and decode steps (split into the steps' own work and the
        share other requests' prefill added), waiting between steps, and the HTTP side after the end."""
        out = dict.fromkeys(("before_engine", "queued", "load", "preempted", "prefill", "decode",
                             "decode_behind_prefill", "between_steps", "after_engine"), 0.0)
        if self.received is not None:
            out["before_engine"] = max(0.0, self.arrival - self.received)
        if not self.spans:
            return out
        out["queued"] = self.spans[0].start - self.arrival
        cursor = self.spans[0].start
        for span in self.spans:
            out["between_steps"] += max(0.0, span.start - cursor)
            length = span.end - span.start
            if span.kind == "decode" and span.step_prefill_tokens and span.step_tokens:
                behind = length * span.step_prefill_tokens / span.step_tokens   # the prefill's share of the step
                out["decode_behind_prefill"] += behind
                length -= behind
            out[span.kind] += length
            cursor = max(cursor, span.end)
        if self.finished is not None:
            out["between_steps"] += max(0.0, self.finished - cursor)      # the last step's own bookkeeping
            if self.last_sent is not None:
                out["after_engine"] = max(0.0, self.last_sent - self.finished)
        return out
