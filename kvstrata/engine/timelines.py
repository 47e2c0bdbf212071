"""The engine thread's record of each request's timeline (kvstrata.core.timeline): a span per step
that computed some of its tokens, and the stretches it spent loading or preempted, observed from
what each step scheduled (the scheduler and the tiers keep no clock: the simulator drives them on
a virtual one)."""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.core.timeline import RequestTimeline, Span
from kvstrata.scheduler.output import SchedulerOutput
from kvstrata.scheduler.scheduler import Scheduler


class TimelineRecorder:
    """Adds spans to the timelines of the requests a step touched. Engine thread only."""

    def __init__(self) -> None:
        self._loading: dict[str, float] = {}        # request id -> when its load began
        self._preempted: dict[str, float] = {}      # request id -> when it lost its blocks

    def step(self, timeline_of: Callable[[str], RequestTimeline | None], output: SchedulerOutput,
             scheduler: Scheduler, start: float, end: float) -> None:
        """Record one step that began at `start` and ended at `end` (monotonic seconds)."""
        for request_id in output.preempted:
            self._preempted.setdefault(request_id, start)
        loading = {request.request_id for request in scheduler.loading}
        for request_id in loading - self._loading.keys():
            self._loading[request_id] = start
            timeline = timeline_of(request_id)
            if timeline is not None:
                self._resumed(timeline, request_id, start)
        for request_id in [rid for rid in self._loading if rid not in loading]:
            began = self._loading.pop(request_id)
            timeline = timeline_of(request_id)
            if timeline is not None:
                timeline.add(Span("load", began, start))
        prefill_tokens = sum(c.num_tokens for c in output.chunks if c.start < c.request.num_prompt_tokens)
        step_tokens = output.num_tokens
        for chunk in output.chunks:
            kind = "prefill" if chunk.start < chunk.request.num_prompt_tokens else "decode"
            for request in (chunk.request, *chunk.forks):
                timeline = timeline_of(request.request_id)
                if timeline is not None:
                    self._resumed(timeline, request.request_id, start)
                    timeline.add(Span(kind, start, end, chunk.num_tokens, step_tokens, prefill_tokens))

    def _resumed(self, timeline: RequestTimeline, request_id: str, at: float) -> None:
        began = self._preempted.pop(request_id, None)
        if began is not None:
            timeline.add(Span("preempted", began, at))

    def forget(self, request_id: str) -> None:
        """A request that finished: nothing more is recorded for it."""
        self._loading.pop(request_id, None)
        self._preempted.pop(request_id, None)
