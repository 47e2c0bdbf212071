"""Prometheus metrics: request outcomes and latencies, queue gauges, and KV blocks by tier and state.

Latencies are observed by the server as responses stream. Engine-side figures (blocks per state,
queue lengths, token counters) come from the last snapshot the engine thread published (at most
one step old), read at scrape time by a collector: a scrape never touches the engine's own state,
and `free + cached + used + in_flight == total` can be checked from outside. Each server has its
own registry, so several can live in one process (tests).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sized

from prometheus_client import CollectorRegistry, Counter, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvstrata.engine.heap_trim import heap_stats
from kvstrata.engine.snapshots import STEP_BUCKETS, EngineSnapshot
from kvstrata.kvcache.block_pool import BlockState

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def length_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_len` (vLLM's token-length buckets)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_len:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


class EngineCollector(Collector):
    """Reads the engine's last published snapshot when Prometheus scrapes."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str):
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self):
        snapshot = self.snapshot()
        yield from self._vllm_style(snapshot)
        requests = GaugeMetricFamily("kvstrata_requests", "Unfinished requests by state", labels=["state"])
        for state in ("running", "loading", "waiting"):
            requests.add_metric([state], getattr(snapshot.requests, state))
        yield requests

        blocks = GaugeMetricFamily("kvstrata_kv_blocks", "KV blocks by tier and state", labels=["tier", "state"])
        for tier, counts in snapshot.blocks.items():
            for state in BlockState:
                blocks.add_metric([tier, state.value], getattr(counts, state.value))
        yield blocks

        stats = snapshot.cache
        prompt = CounterMetricFamily("kvstrata_prompt_tokens", "Prompt tokens by where their KV came from",
                                     labels=["source"])
        prompt.add_metric(["computed"], stats.prompt_tokens - sum(stats.hit_tokens.values()))
        for tier, tokens in stats.hit_tokens.items():
            prompt.add_metric([tier], tokens)
        yield prompt
        run = snapshot.engine
        yield CounterMetricFamily("kvstrata_generation_tokens", "Tokens generated", value=run.generated_tokens)
        yield CounterMetricFamily("kvstrata_preemptions", "Requests preempted", value=snapshot.num_preemptions)
        yield _by_label("kvstrata_evicted_blocks", "Cached blocks evicted, by tier", "tier", stats.evicted_blocks)
        yield _by_label("kvstrata_offloaded_blocks", "Blocks copied down to a tier", "tier", stats.offloaded_blocks)
        yield _by_label("kvstrata_loaded_blocks", "Blocks loaded up from a tier", "tier", stats.loaded_blocks)
        yield _by_label("kvstrata_load_failures", "Store loads that fell back to recompute, by reason", "reason",
                        stats.load_failures)
        yield _by_label("kvstrata_store_errors", "Store operations that failed, by kind", "kind", stats.store_errors)
        if snapshot.store_errors is not None:      # a Redis Cluster's dead node costs misses, seen only here
            yield _by_label("kvstrata_store_backend_errors", "Failed store calls as the store counts them (a "
                            "cluster's per-node failures included), by kind", "kind", snapshot.store_errors)
        yield _by_label("kvstrata_transfer_faults", "KV copies, encodes and decodes that raised (their blocks are "
                        "recomputed), by operation", "operation", stats.faults)
        yield CounterMetricFamily("kvstrata_store_dropped_writes", "Store writes dropped (queue full)",
                                  value=stats.dropped_writes)
        yield CounterMetricFamily("kvstrata_store_load_seconds", "Seconds spent waiting for store loads",
                                  value=stats.load_seconds)
        yield CounterMetricFamily("kvstrata_audit_failures", "audit() failures", value=run.audit_failures)
        yield from _heap()
        yield CounterMetricFamily("kvstrata_step_failures", "Engine steps that raised (their requests ended with "
                                  "an error, their blocks released)", value=run.step_failures)
        yield CounterMetricFamily("kvstrata_engine_steps", "Engine steps", value=run.steps)
        yield GaugeMetricFamily("kvstrata_kv_unmapped_bytes", "KV buffer bytes not yet mapped: an idle engine maps "
                                "them; until then a step's first write to one pays the page fault",
                                value=snapshot.kv_unmapped_bytes)
        seconds = CounterMetricFamily("kvstrata_engine_step_seconds", "Seconds engine steps took, by part "
                                      "(schedule: scheduling and admission; model: the model and the sampler; "
                                      "rest: bookkeeping, caching, detokenizing)", labels=["part"])
        for part, value in (("schedule", run.schedule_seconds), ("model", run.model_seconds),
                            ("rest", run.step_seconds - run.schedule_seconds - run.model_seconds)):
            seconds.add_metric([part], value)
        yield seconds
        steps = HistogramMetricFamily("kvstrata_step_duration_seconds", "Engine step durations (schedule, model, "
                                      "bookkeeping)", labels=["model_name"])
        cumulative = list(itertools.accumulate(run.step_counts))
        steps.add_metric([self.model_name], [(str(b), c) for b, c in zip(STEP_BUCKETS, cumulative)]
                         + [("+Inf", cumulative[-1])], sum_value=run.step_seconds)
        yield steps

    def _vllm_style(self, snapshot: EngineSnapshot):
        """The figures vLLM dashboards chart, under kvstrata names, labelled with the model."""
        stats, labels, model = snapshot.cache, ["model_name"], [self.model_name]
        queries = CounterMetricFamily("kvstrata_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache (at first admission)", labels=labels)
        queries.add_metric(model, stats.prompt_tokens)
        yield queries
        hits = CounterMetricFamily("kvstrata_prefix_cache_hits", "Prompt tokens served from any cache tier",
                                   labels=labels)
        hits.add_metric(model, sum(stats.hit_tokens.values()))
        yield hits
        usage = GaugeMetricFamily("kvstrata_kv_cache_usage_perc", "Fraction of device KV blocks held by "
                                  "requests or transfers (1 = full; cached blocks count as free)", labels=labels)
        device = snapshot.blocks["device"]
        usage.add_metric(model, (device.used + device.in_flight) / max(1, device.total))
        yield usage
        run = snapshot.engine
        for name, documentation, value in (
                ("drafts", "Speculative steps of a request (each verifies its draft tokens)", run.spec_decode_num_drafts),
                ("draft_tokens", "Draft tokens verified", run.spec_decode_num_draft_tokens),
                ("accepted_tokens", "Draft tokens accepted", run.spec_decode_num_accepted_tokens)):
            family = CounterMetricFamily(f"kvstrata_spec_decode_num_{name}", documentation, labels=labels)
            family.add_metric(model, value)
            yield family
        per_pos = CounterMetricFamily("kvstrata_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, "
                                      "by position in their step (0: the first draft)", labels=[*labels, "position"])
        for position, value in enumerate(run.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, str(position)], value)
        yield per_pos


def _heap():
    """Where resident memory goes beyond the KV buffers: malloc's bytes in use and free (glibc), and the
    Python objects alive (pymalloc blocks). A long run that grows one of these says which kind it is."""
    stats = heap_stats()
    if stats is not None:
        heap = GaugeMetricFamily("kvstrata_heap_bytes", "malloc's bytes (jemalloc's under --allocator, else glibc's): "
                                 "in_use (handed out) and free (held beyond that, not returned to the OS)", labels=["kind"])
        heap.add_metric(["in_use"], stats.in_use)
        heap.add_metric(["free"], stats.free)
        yield heap
    yield GaugeMetricFamily("kvstrata_python_allocated_blocks", "Python's allocated memory blocks "
                            "(sys.getallocatedblocks): objects alive", value=sys.getallocatedblocks())


class BoundedStores(Collector):
    """How full each of the server's bounded stores is (entries kept, and the most it keeps): a long
    run whose memory still grows while one of them fills has not reached its plateau yet."""

    def __init__(self, stores: dict[str, Sized]):
        self.stores = stores

    def collect(self):
        kept = GaugeMetricFamily("kvstrata_bounded_store_entries", "Entries a bounded store keeps now", labels=["store"])
        capacity = GaugeMetricFamily("kvstrata_bounded_store_capacity", "The most entries it keeps", labels=["store"])
        for name, store in self.stores.items():
            kept.add_metric([name], len(store))
            capacity.add_metric([name], store.capacity)       # type: ignore[attr-defined]
        yield kept
        yield capacity


def _by_label(name: str, documentation: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


class ServerMetrics:
    """Everything `/metrics` exports for one server. Request-level series carry a `model_name` label
    (as vLLM's do); `process_*` and `python_*` are prometheus_client's standard collectors."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], max_model_len: int, model_name: str = "model"):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(snapshot, model_name))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        r, name = self.registry, ["model_name"]

        def histogram(metric: str, doc: str, buckets) -> Histogram:
            return Histogram(metric, doc, name, buckets=buckets, registry=r).labels(model_name)

        self.requests = Counter("kvstrata_requests_finished", "Requests by outcome (rejected: refused with an "
                                "error before any token)", ["model_name", "outcome"], registry=r)
        self.model_name = model_name
        self.ttft = histogram("kvstrata_time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.tpot = histogram("kvstrata_time_per_output_token_seconds", "Time per output token after the first",
                              LATENCY_BUCKETS)
        self.e2e = histogram("kvstrata_e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS)
        self.queue = histogram("kvstrata_request_queue_time_seconds", "Arrival to the first step that computes "
                               "the request (includes store loads)", LATENCY_BUCKETS)
        self.prefill = histogram("kvstrata_request_prefill_time_seconds", "First step that computes the request "
                                 "to its first token", LATENCY_BUCKETS)
        self.decode = histogram("kvstrata_request_decode_time_seconds", "First token to the end",
                                LATENCY_BUCKETS)
        self.prompt_len = histogram("kvstrata_request_prompt_tokens", "Prompt tokens per finished request",
                                    length_buckets(max_model_len))
        self.output_len = histogram("kvstrata_request_generation_tokens", "Generated tokens per finished "
                                    "request", length_buckets(max_model_len))
        self.handoffs = Counter("kvstrata_kv_transfer_requests", "Prefill/decode handoffs, by role and outcome "
                                "(prefill: stored_all, stored_part, stored_none; decode: loaded, recomputed)",
                                ["model_name", "role", "outcome"], registry=r)
        self.handoff_tokens = Counter("kvstrata_kv_transfer_tokens", "Prompt tokens of handoffs (prefill: stored; "
                                      "decode: handed_over, recomputed)", ["model_name", "role", "kind"], registry=r)
        self.store_wait = histogram("kvstrata_kv_transfer_store_wait_seconds", "How long a prefill engine's "
                                    "answer waited for its blocks' store writes", LATENCY_BUCKETS)

    def handoff(self, role: str, outcome: str, tokens: dict[str, int], store_wait: float | None = None) -> None:
        self.handoffs.labels(self.model_name, role, outcome).inc()
        for kind, count in tokens.items():
            self.handoff_tokens.labels(self.model_name, role, kind).inc(count)
        if store_wait is not None:
            self.store_wait.observe(store_wait)

    def observe(self, outcome: str, arrival: float, first_token: float | None, end: float, num_output: int,
                num_prompt: int | None = None, first_scheduled: float | None = None) -> None:
        self.requests.labels(self.model_name, outcome).inc()
        self.e2e.observe(end - arrival)
        if num_prompt is not None:
            self.prompt_len.observe(num_prompt)
            self.output_len.observe(num_output)
        if first_scheduled is not None:
            self.queue.observe(max(0.0, first_scheduled - arrival))
            if first_token is not None:
                self.prefill.observe(max(0.0, first_token - first_scheduled))
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            self.decode.observe(end - first_token)
            if num_output > 1:
                self.tpot.observe((end - first_token) / (num_output - 1))

    def rejected(self) -> None:
        """A request refused with an error (bad input, unknown model, auth, full queue, too long)."""
        self.requests.labels(self.model_name, "rejected").inc()
