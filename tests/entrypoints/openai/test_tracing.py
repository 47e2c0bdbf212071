"""OpenTelemetry traces (`--otlp-traces-endpoint`): a request served becomes one trace whose spans are its
timeline's, on the wall clock; off by default (no SDK imported); an exporter that raises or hangs, a
collector that is down, or a bug building the spans never fails a request."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvstrata.core.outputs import RequestOutput
from kvstrata.core.timeline import RequestTimeline, Span
from kvstrata.entrypoints.cli.main import main
from kvstrata.entrypoints.openai.tracing import RequestTracing, otlp_traces_url
from tests.entrypoints.server_helpers import MODEL, free_port, running_server

PROMPT = list(range(100, 140))      # 40 tokens: chunks of 16, 16 and 8 under a 16-token step budget


def children_of(spans, parent) -> list:
    return sorted((s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
                  key=lambda s: s.start_time)


def traces(exporter: InMemorySpanExporter) -> dict[str, list]:
    """request id -> its trace's spans, root first."""
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.parent is None]
    return {root.attributes["gen_ai.request.id"]: [root] + [s for s in spans if s is not root
                                                             and s.context.trace_id == root.context.trace_id]
            for root in roots}


def test_a_request_served_becomes_one_trace_of_its_timeline(smollm2):
    exporter = InMemorySpanExporter()
    tracing = RequestTracing(exporter)
    body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    with running_server(smollm2, tracing=tracing, max_num_batched_tokens=16, block_size=16) as (base, _):
        before = time.time_ns()
        whole = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as reply:
            events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
        after = time.time_ns()
        kept = httpx.get(f"{base}/v1/timelines", params={"id": [whole["id"], events[0]["id"]]}).json()["timelines"]
    tracing.force_flush()
    tracing.shutdown()
    by_id = traces(exporter)
    assert sorted(by_id) == sorted(kept) == sorted([whole["id"], events[0]["id"]])

    root, *rest = by_id[whole["id"]]
    timeline = RequestTimeline.from_dict(kept[whole["id"]])
    assert root.name == "llm_request" and root.kind.name == "SERVER" and root.resource.attributes["service.name"]
    attrs = root.attributes
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == MODEL
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (40, 5)
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == whole["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == ("length",) and attrs["gen_ai.request.n"] == 1
    parts = timeline.breakdown()
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(timeline.first_sent - timeline.received)
    assert attrs["gen_ai.latency.e2e"] == pytest.approx(timeline.last_sent - timeline.received)
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(parts["queued"])
    assert all(attrs[f"kvstrata.time.{part}"] == pytest.approx(seconds) for part, seconds in parts.items())

    # Children: queued, each prefill chunk, one summary of the decode run; all directly under the root.
    kinds = [s.kind for s in timeline.spans]
    assert kinds == ["prefill"] * 3 + ["decode"] * 4
    children = children_of(rest, root)
    assert len(children) == len(rest) and [c.name for c in children] == ["queued", "prefill", "prefill", "prefill",
                                                                          "decode"]
    assert [c.attributes["kvstrata.tokens"] for c in children[1:4]] == [16, 16, 8]
    decode = children[4].attributes
    assert (decode["kvstrata.steps"], decode["kvstrata.tokens"]) == (4, 4)
    steps = timeline.spans[3:]
    assert decode["kvstrata.decode.step_seconds"] == pytest.approx(sum(s.end - s.start for s in steps))
    assert decode["kvstrata.decode.longest_step_seconds"] == pytest.approx(max(s.end - s.start for s in steps))

    # One monotonic -> wall offset for every time of every trace, and it is the wall clock's.
    expected = [(timeline.received, timeline.last_sent), (timeline.arrival, timeline.spans[0].start),
                *[(s.start, s.end) for s in timeline.spans[:3]], (steps[0].start, steps[-1].end)]
    assert [(s.start_time, s.end_time) for s in [root, *children]] == [
        (tracing.ns(a), tracing.ns(b)) for a, b in expected]
    assert before <= root.start_time <= root.end_time <= after
    assert all(root.start_time <= c.start_time <= c.end_time <= root.end_time for c in children)

    streamed_root, *streamed = by_id[events[0]["id"]]
    assert streamed_root.attributes["gen_ai.usage.cache_read.input_tokens"] == 32   # two blocks of the first's
    assert [c.name for c in children_of(streamed, streamed_root)][0] == "queued"


def output(index: int, timeline: RequestTimeline, reason: str = "stop", tokens: int = 3) -> RequestOutput:
    return RequestOutput("cmpl-x", [], "", True, reason, 8, 0, tokens, index=index, timeline=timeline)


def test_samples_loads_and_preemptions_nest_under_the_root_in_order():
    exporter = InMemorySpanExporter()
    tracing = RequestTracing(exporter)
    # Sample 0 loads, prefills, decodes twice (the second behind another's prefill: 2 of 4 step tokens),
    # is preempted, prefills again and decodes once. Sample 1 is plain.
    a = RequestTimeline(10.0, [Span("load", 10.1, 10.2), Span("prefill", 10.2, 10.3, 8, 8, 8),
                               Span("decode", 10.4, 10.5, 1, 1, 0), Span("decode", 10.7, 10.9, 1, 4, 2),
                               Span("preempted", 11.0, 12.0), Span("prefill", 12.0, 12.1, 10, 10, 10),
                               Span("decode", 12.2, 12.3, 1, 1, 0)], finished=12.4)
    b = RequestTimeline(10.0, [Span("prefill", 10.2, 10.3, 8, 8, 8), Span("decode", 10.4, 10.5, 1, 1, 0)],
                        finished=10.6)
    tracing.record("cmpl-x", MODEL, [output(0, a, "length"), output(1, b, "error", 2)], 9.9, 10.35, 12.5)
    tracing.force_flush()
    tracing.shutdown()
    spans = exporter.get_finished_spans()
    root, = [s for s in spans if s.parent is None]
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length", "error")
    assert root.status.status_code.name == "ERROR" and root.attributes["gen_ai.usage.output_tokens"] == 5
    samples = children_of(spans, root)
    assert [(s.name, s.attributes["kvstrata.sample"]) for s in samples] == [("sample", 0), ("sample", 1)]
    assert (samples[0].start_time, samples[0].end_time) == (tracing.ns(10.0), tracing.ns(12.4))
    first = children_of(spans, samples[0])
    assert [s.name for s in first] == ["queued", "load", "prefill", "decode", "preempted", "prefill", "decode"]
    assert (first[0].start_time, first[0].end_time) == (tracing.ns(10.0), tracing.ns(10.1))
    run = first[3].attributes
    assert (first[3].start_time, first[3].end_time) == (tracing.ns(10.4), tracing.ns(10.9))
    assert (run["kvstrata.steps"], run["kvstrata.tokens"]) == (2, 2)
    assert run["kvstrata.decode.behind_prefill_seconds"] == pytest.approx(0.1)
    assert run["kvstrata.decode.longest_gap_seconds"] == pytest.approx(0.2)
    assert run["kvstrata.decode.longest_step_seconds"] == pytest.approx(0.2)
    assert first[6].attributes["kvstrata.steps"] == 1
    assert samples[0].attributes["kvstrata.time.preempted"] == pytest.approx(1.0)
    assert [s.name for s in children_of(spans, samples[1])] == ["queued", "prefill", "decode"]
    assert len(spans) == 1 + 2 + 7 + 3


def test_record_never_waits_for_the_builder(monkeypatch):
    tracing = RequestTracing(InMemorySpanExporter(), max_pending=1)
    started, release, built = threading.Event(), threading.Event(), []
    monkeypatch.setattr(tracing, "_record", lambda *item: (started.set(), release.wait(10), built.append(item[0])))
    timeline = RequestTimeline(1.0, [Span("prefill", 1.1, 1.2, 8, 8, 8)], finished=1.3)
    tracing.record("a", MODEL, [output(0, timeline)], 0.9, 1.2, 1.4)
    assert started.wait(10)             # the builder holds "a"
    began = time.monotonic()
    for rid in ("b", "c"):              # "b" waits in the queue, "c" finds it full
        tracing.record(rid, MODEL, [output(0, timeline)], 0.9, 1.2, 1.4)
    assert time.monotonic() - began < 0.5 and tracing.dropped == 1
    release.set()
    tracing.shutdown()
    assert built == ["a", "b"]


def test_off_by_default_nothing_of_opentelemetry_is_imported():
    code = ("import sys\n"
            "from kvstrata.entrypoints.cli.main import build_parser\n"
            "import kvstrata.entrypoints.cli.serve, kvstrata.entrypoints.openai.api_server\n"
            "assert build_parser().parse_args(['serve']).otlp_traces_endpoint is None\n"
            # FastAPI itself imports opentelemetry's API (its own telemetry, a no-op without a provider).
            "print([m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter',"
            " 'kvstrata.entrypoints.openai.tracing'))])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_without_the_packages_the_flag_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    assert main(["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4318"]) == 2   # before any model loads
    assert "pip install 'kvstrata[otel]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ValueError, match=r"pip install 'kvstrata\[otel\]'"):
        RequestTracing(InMemorySpanExporter())
    assert main(["serve", "--otlp-traces-endpoint", "localhost:4318"]) == 2
    assert "must be an http:// or https:// URL" in capsys.readouterr().err


def test_the_endpoint_gets_the_traces_path_when_it_has_none():
    assert otlp_traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert otlp_traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"


class FailingExporter(InMemorySpanExporter):
    """Raises on every export, or (hang=True) blocks each export until released."""

    def __init__(self, hang: bool = False):
        super().__init__()
        self.hang, self.calls, self.release = hang, 0, threading.Event()

    def export(self, spans) -> SpanExportResult:
        self.calls += 1
        if self.hang:
            self.release.wait(30)
            return SpanExportResult.FAILURE
        raise ConnectionError("the collector is on fire")


def serve_two(base: str) -> None:
    """A whole and a streamed request, both answered in full."""
    body = {"prompt": "Hello there", "max_tokens": 4, "ignore_eos": True}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as streamed:
        lines = list(streamed.iter_lines())
    assert streamed.status_code == 200 and "data: [DONE]" in lines


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition()


@pytest.mark.parametrize("failure", ["raises", "hangs", "bug"])
def test_an_exporter_that_fails_or_a_bug_never_fails_a_request(smollm2, failure, monkeypatch, caplog):
    exporter = FailingExporter(hang=failure == "hangs")
    tracing = RequestTracing(exporter, schedule_delay=0.01)
    if failure == "bug":
        monkeypatch.setattr(tracing, "_record", lambda *_: 1 / 0)
    with running_server(smollm2, tracing=tracing) as (base, _):
        serve_two(base)                 # while the exporter raises, hangs, or nothing is built at all
        if failure != "bug":
            wait_for(lambda: exporter.calls >= 1)
        serve_two(base)                 # and after: a hanging exporter holds its thread, never the loop
    exporter.release.set()
    tracing.shutdown()
    if failure == "bug":
        assert tracing.failures == 4 and exporter.calls == 0
        assert sum("could not trace request" in r.message for r in caplog.records) == 1


def test_a_collector_that_is_down_costs_dropped_spans_and_nothing_else(smollm2, caplog):
    tracing = RequestTracing.otlp(f"http://127.0.0.1:{free_port()}", timeout=0.5, schedule_delay=0.01,
                                  shutdown_timeout=3.0)
    with caplog.at_level(logging.WARNING), running_server(smollm2, tracing=tracing) as (base, _):
        serve_two(base)
        wait_for(lambda: any(r.name.startswith("opentelemetry.exporter") and r.levelno >= logging.ERROR
                             for r in caplog.records))
        serve_two(base)
    began = time.monotonic()
    tracing.shutdown()
    assert time.monotonic() - began < 4.0


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP receiver on a free loopback port: keeps each POST's decoded ExportTraceServiceRequest."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, ExportTraceServiceRequest.FromString(body)))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *_):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_the_otlp_exporter_delivers_the_trace_to_a_collector(smollm2):
    collector = Collector()
    tracing = RequestTracing.otlp(f"http://127.0.0.1:{collector.server_address[1]}", schedule_delay=0.01)
    try:
        with running_server(smollm2, tracing=tracing) as (base, _):
            rid = httpx.post(f"{base}/v1/completions", json={"prompt": "Hello there", "max_tokens": 3,
                                                            "ignore_eos": True}, timeout=60).json()["id"]
        tracing.shutdown()        # sends what is still queued
    finally:
        collector.shutdown()
    assert {path for path, _ in collector.received} == {"/v1/traces"}
    spans = [span for _, request in collector.received for resource in request.resource_spans
             for scope in resource.scope_spans for span in scope.spans]
    root, = [s for s in spans if not s.parent_span_id]
    attributes = {a.key: a.value for a in root.attributes}
    assert root.name == "llm_request" and attributes["gen_ai.request.id"].string_value == rid
    assert sorted(s.name for s in spans if s.parent_span_id == root.span_id) == ["decode", "prefill", "queued"]
