"""OpenTelemetry traces of the requests served (`kvstrata serve --otlp-traces-endpoint URL`, vLLM's flag):
each request's timeline (kvstrata.core.timeline), handed over with its last output, becomes one trace,
exported over OTLP/HTTP (protobuf) in batches by the SDK's worker thread.

One trace per engine request (a `/v1/completions` call with several prompts makes one per prompt, as
its timelines and ids do):

    llm_request  (SERVER; received -> last byte sent)       gen_ai.* attributes, kvstrata.time.* breakdown
    ├── queued       arrival -> first step (or load)
    ├── load         a lower-tier load it waited for, each
    ├── prefill      one per prefill chunk: kvstrata.tokens, kvstrata.step.tokens, kvstrata.step.prefill_tokens
    ├── decode       one per run of consecutive decode steps (first step's start -> last step's end):
    │                kvstrata.steps, kvstrata.tokens, kvstrata.decode.{step,behind_prefill,between_steps,
    │                longest_step,longest_gap}_seconds
    ├── preempted    each preemption (a prefill and a new decode run follow)
    └── ...          in the timeline's order

With n > 1 (or best_of) the root has one `sample` span per sample (its arrival -> its end, carrying its
breakdown), with that sample's spans beneath.

Decode steps are summarised, not a span each: a request's span count then grows with its scheduling
events (chunks, loads, preemptions), never with its output length. A 2,000-token answer would otherwise
be 2,000 spans: at a few requests a second that fills the batch processor's queue (2,048 spans, then it
drops) and a collector's storage with spans nobody reads one by one. A stall inside a run shows as
`longest_step_seconds` / `longest_gap_seconds`; the step-by-step record stays at `GET /v1/timelines?id=`.

Times: the timeline's `time.monotonic()` seconds plus one offset to the wall clock, taken when the
exporter is built (a later change of the wall clock does not bend a trace).

Off by default, and then nothing here runs and no OpenTelemetry SDK module is imported: this module
imports the SDK only when a `RequestTracing` is built. Tracing never reaches a request: the event loop
only queues the finished request (its outputs and timelines are never changed again); a thread of ours
builds the spans (the SDK's span costs tens of microseconds, a trace a few hundred: too much for the
loop) and hands them to the batch processor, whose own thread exports them. A collector that is down or
slow costs dropped spans and a warning a minute, nothing else; a failure building spans is logged once
and counted.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from kvstrata.core.outputs import RequestOutput
from kvstrata.core.timeline import RequestTimeline, Span

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'kvstrata[otel]'"
TRACES_PATH = "/v1/traces"      # OTLP/HTTP's path for traces, added to an endpoint given without a path


def otlp_traces_url(endpoint: str) -> str:
    """`http://collector:4318` -> `http://collector:4318/v1/traces`; a URL with a path is kept as given."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL, not {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + TRACES_PATH


class RequestTracing:
    """Turns finished requests into traces and hands them to `exporter` (any OpenTelemetry `SpanExporter`)
    through a `BatchSpanProcessor` (`schedule_delay` seconds between exports, at most `max_queue` spans
    waiting). `record` is called on the event loop, never waits and never raises; at most `max_pending`
    requests wait for their spans to be built. `shutdown` sends what is queued (waiting at most
    `shutdown_timeout` seconds) and stops both threads."""

    def __init__(self, exporter, service_name: str | None = None, schedule_delay: float = 1.0,
                 max_queue: int = 2048, max_pending: int = 4096, shutdown_timeout: float = 5.0):
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode
        except ImportError as exc:
            raise ValueError(f"tracing needs OpenTelemetry's SDK, which is not installed: {INSTALL_HINT}") from exc
        from kvstrata import __version__

        self._server, self._error = SpanKind.SERVER, Status(StatusCode.ERROR)
        resource = Resource.create({"service.name": service_name or os.environ.get("OTEL_SERVICE_NAME")
                                    or "kvstrata", "service.version": __version__})
        # Our own provider, never the global one: FastAPI's own telemetry and any other user of the
        # global provider are left as they were.
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=max_queue,
                                                             schedule_delay_millis=schedule_delay * 1000))
        self._tracer = self._provider.get_tracer("kvstrata", __version__)
        self._shutdown_timeout = shutdown_timeout
        self.offset_ns = time.time_ns() - round(time.monotonic() * 1e9)   # monotonic s -> wall ns
        self.failures = self.dropped = 0
        _quiet_queue_full_warnings()
        self._pending: queue.Queue = queue.Queue(maxsize=max_pending)
        self._builder = threading.Thread(target=self._build, name="kvstrata-tracing", daemon=True)
        self._builder.start()

    @classmethod
    def otlp(cls, endpoint: str, timeout: float | None = None, **options) -> RequestTracing:
        """Export to an OTLP/HTTP collector at `endpoint`. `timeout`: seconds an export may take, retries
        included (None: $OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, else 10); the OTEL_EXPORTER_OTLP_* variables
        (headers, certificates, compression) apply as usual."""
        url = otlp_traces_url(endpoint)
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ValueError(f"--otlp-traces-endpoint needs the OpenTelemetry OTLP exporter, which is not "
                             f"installed: {INSTALL_HINT}") from exc
        tracing = cls(OTLPSpanExporter(endpoint=url, timeout=timeout), **options)
        logger.info("tracing: a trace of each request goes to %s (OTLP/HTTP)", url)
        return tracing

    def ns(self, t: float) -> int:
        """A monotonic time in seconds as wall-clock nanoseconds since the epoch."""
        return self.offset_ns + round(t * 1e9)

    def record(self, request_id: str, model: str, outputs: Sequence[RequestOutput], received: float,
               first_sent: float | None, end: float) -> None:
        """Queue one trace for a request that ended: `outputs`, each sample's last output (a finished one
        carries the sample's timeline), none of them changed after; HTTP times in monotonic seconds. Never
        raises, never waits: with `max_pending` requests already waiting, this one is dropped."""
        try:
            self._pending.put_nowait((request_id, model, tuple(outputs), received, first_sent, end))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("tracing: requests end faster than their spans are built; dropping traces")

    def _build(self) -> None:
        """The builder thread: the queued requests' spans, until shutdown queues None."""
        while (item := self._pending.get()) is not None:
            try:
                self._record(*item)
            except Exception:    # a bug here must cost a trace, never a request nor the thread
                self.failures += 1
                if self.failures == 1:
                    logger.warning("tracing: could not trace request %s; later failures are counted, not logged",
                                   item[0], exc_info=True)
            finally:
                self._pending.task_done()

    def force_flush(self, timeout: float = 5.0) -> bool:
        """Build what is queued and export it now, on the caller's thread (for tests; never on the event loop)."""
        self._pending.join()
        return self._provider.force_flush(int(timeout * 1000))

    def shutdown(self) -> None:
        """Send what is queued and stop, waiting `shutdown_timeout` seconds at most: the SDK's own shutdown
        can wait 30 s on a collector that is down; what is not sent by then is dropped."""
        def close() -> None:
            self._pending.put(None)
            self._builder.join()
            self._provider.shutdown()

        closing = threading.Thread(target=close, name="kvstrata-tracing-shutdown", daemon=True)
        closing.start()
        closing.join(self._shutdown_timeout)
        if closing.is_alive():
            logger.warning("tracing: the collector took no spans within %.0fs of shutdown; the rest are dropped",
                           self._shutdown_timeout)

    def _record(self, request_id: str, model: str, outputs: Sequence[RequestOutput], received: float,
                first_sent: float | None, end: float) -> None:
        timelines = {out.index: out.timeline for out in outputs if out.timeline is not None}
        last = outputs[-1] if outputs else None
        attributes = {
            "gen_ai.request.id": request_id, "gen_ai.response.id": request_id,
            "gen_ai.request.model": model, "gen_ai.response.model": model,
            "gen_ai.request.n": max(len(outputs), 1),
            "gen_ai.usage.input_tokens": last.num_prompt_tokens if last else 0,
            "gen_ai.usage.cache_read.input_tokens": last.num_cached_tokens if last else 0,
            "gen_ai.usage.output_tokens": sum(out.num_output_tokens for out in outputs),
            "gen_ai.response.finish_reasons": [_finish_reason(out) for out in outputs] or ["abort"],
            "gen_ai.latency.e2e": end - received,
        }
        if first_sent is not None:
            attributes["gen_ai.latency.time_to_first_token"] = first_sent - received
        if timelines:
            first = timelines[min(timelines)]
            parts = first.breakdown()
            attributes["gen_ai.latency.time_in_queue"] = parts["queued"]
            attributes["gen_ai.latency.time_in_model_prefill"] = parts["prefill"]
            attributes["gen_ai.latency.time_in_model_decode"] = parts["decode"] + parts["decode_behind_prefill"]
            if first.spans and first.finished is not None:
                attributes["gen_ai.latency.time_in_model_inference"] = first.finished - first.spans[0].start
            if len(timelines) == 1:
                attributes.update(_breakdown_attributes(parts))
        root = self._tracer.start_span("llm_request", kind=self._server, attributes=attributes,
                                       start_time=self.ns(received))
        if any(reason == "error" for reason in attributes["gen_ai.response.finish_reasons"]):
            root.set_status(self._error)
        for index, timeline in sorted(timelines.items()):
            finished = timeline.finished if timeline.finished is not None else end
            if len(timelines) == 1:
                self._children(timeline, root, finished)
                continue
            sample = self._child("sample", timeline.arrival, None, root,
                                 {"kvstrata.sample": index, **_breakdown_attributes(timeline.breakdown())})
            self._children(timeline, sample, finished)
            sample.end(self.ns(finished))
        root.end(self.ns(end))

    def _child(self, name: str, start: float, end: float | None, parent, attributes: Mapping | None = None):
        """A span under `parent`, ended at `end` (None: left open for the caller to end)."""
        from opentelemetry.trace import set_span_in_context

        span = self._tracer.start_span(name, context=set_span_in_context(parent), attributes=attributes,
                                       start_time=self.ns(start))
        if end is not None:
            span.end(self.ns(end))
        return span

    def _children(self, timeline: RequestTimeline, parent, end: float) -> None:
        spans = timeline.spans
        self._child("queued", timeline.arrival, spans[0].start if spans else end, parent)
        i = 0
        while i < len(spans):
            span = spans[i]
            if span.kind != "decode":
                attributes = ({"kvstrata.tokens": span.tokens, "kvstrata.step.tokens": span.step_tokens,
                               "kvstrata.step.prefill_tokens": span.step_prefill_tokens}
                              if span.kind == "prefill" else None)
                self._child(span.kind, span.start, span.end, parent, attributes)
                i += 1
                continue
            run = i
            while i < len(spans) and spans[i].kind == "decode":
                i += 1
            steps = spans[run:i]
            self._child("decode", steps[0].start, steps[-1].end, parent, _decode_summary(steps))


def _decode_summary(steps: Sequence[Span]) -> dict:
    """A run of decode steps in attributes: how many, their tokens, the time inside steps (and the share
    of it other requests' prefill added), the waits between them, and the longest of each."""
    lengths = [s.end - s.start for s in steps]
    gaps = [max(0.0, b.start - a.end) for a, b in zip(steps, steps[1:])]
    behind = sum((s.end - s.start) * s.step_prefill_tokens / s.step_tokens for s in steps if s.step_tokens)
    return {"kvstrata.steps": len(steps), "kvstrata.tokens": sum(s.tokens for s in steps),
            "kvstrata.decode.step_seconds": sum(lengths), "kvstrata.decode.behind_prefill_seconds": behind,
            "kvstrata.decode.between_steps_seconds": sum(gaps),
            "kvstrata.decode.longest_step_seconds": max(lengths),
            "kvstrata.decode.longest_gap_seconds": max(gaps, default=0.0)}


def _breakdown_attributes(parts: Mapping[str, float]) -> dict[str, float]:
    return {f"kvstrata.time.{part}": seconds for part, seconds in parts.items()}


def _finish_reason(out: RequestOutput) -> str:
    return (out.finish_reason or "abort") if out.finished else "abort"


class _OncePerMinute(logging.Filter):
    """Lets the batch processor's "Queue full, dropping Span." (one line per span dropped, on the event
    loop) through once a minute: a collector that is down must not flood the log."""

    def __init__(self):
        super().__init__()
        self._next = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Queue full"):
            return True
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + 60.0
        return True


def _quiet_queue_full_warnings() -> None:
    sdk_log = logging.getLogger("opentelemetry.sdk._shared_internal")
    if not any(isinstance(f, _OncePerMinute) for f in sdk_log.filters):
        sdk_log.addFilter(_OncePerMinute())
