"""Request timelines: the engine records a span per step that computed a request's tokens, and its
loads and preemptions; the breakdown accounts for every second between arrival and the end."""

from __future__ import annotations

import math
from types import SimpleNamespace

import httpx
import pytest

from kvstrata.core.sampling_params import SamplingParams
from kvstrata.core.timeline import RequestTimeline
from kvstrata.engine.timelines import TimelineRecorder
from tests.entrypoints.server_helpers import running_server, scrape


def test_engine_records_each_prefill_chunk_and_decode_step(make_engine):
    engine = make_engine(max_num_batched_tokens=32, block_size=16)
    out, = engine.generate([list(range(100, 180))], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    timeline = out.timeline
    kinds = [span.kind for span in timeline.spans]
    assert kinds == ["prefill"] * math.ceil(80 / 32) + ["decode"] * 5
    assert [span.tokens for span in timeline.spans[:3]] == [32, 32, 16]
    assert all(a.end <= b.start for a, b in zip(timeline.spans, timeline.spans[1:]))
    parts = timeline.breakdown()
    assert sum(parts.values()) == pytest.approx(timeline.finished - timeline.arrival, abs=1e-6)
    assert parts["prefill"] > 0 and parts["decode"] > 0 and parts["load"] == parts["preempted"] == 0


def request(rid: str, prompt: int = 8) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt)


def chunk(req: SimpleNamespace, start: int, n: int) -> SimpleNamespace:
    return SimpleNamespace(request=req, start=start, num_tokens=n, forks=())


def test_recorder_spans_loads_preemptions_and_decodes_behind_prefill():
    a, b = request("a"), request("b")
    timelines = {"a": RequestTimeline(0.0), "b": RequestTimeline(0.0)}
    recorder = TimelineRecorder()
    steps = [  # (chunks, preempted, loading) of steps one second apart
        ([chunk(a, 0, 8)], [], [b]),               # a prefills; b starts loading
        ([chunk(a, 8, 1), chunk(b, 4, 4)], [], []),   # b's load ended; a decodes behind b's prefill
        ([chunk(b, 8, 1)], ["a"], []),             # a is preempted
        ([chunk(a, 0, 9)], [], []),                # a is back
    ]
    for second, (chunks, preempted, loading) in enumerate(steps):
        output = SimpleNamespace(chunks=chunks, preempted=preempted, num_tokens=sum(c.num_tokens for c in chunks))
        recorder.step(timelines.get, output, SimpleNamespace(loading=loading), float(second), second + 0.5)
    assert [(s.kind, s.start, s.end) for s in timelines["b"].spans] == [
        ("load", 0.0, 1.0), ("prefill", 1.0, 1.5), ("decode", 2.0, 2.5)]
    assert [(s.kind, s.start, s.end) for s in timelines["a"].spans] == [
        ("prefill", 0.0, 0.5), ("decode", 1.0, 1.5), ("preempted", 2.0, 3.0), ("prefill", 3.0, 3.5)]
    behind = timelines["a"].spans[1]
    assert (behind.step_tokens, behind.step_prefill_tokens) == (5, 4)
    parts = timelines["a"].breakdown()
    assert parts["decode_behind_prefill"] == pytest.approx(0.5 * 4 / 5) and parts["preempted"] == 1.0
    assert parts["between_steps"] == pytest.approx(1.0) and parts["prefill"] == 1.0
    again = RequestTimeline.from_dict(timelines["a"].as_dict())
    assert again.spans == timelines["a"].spans and again.breakdown() == parts


def test_server_keeps_timelines_and_a_step_histogram(smollm2):
    with running_server(smollm2, num_device_blocks=64, block_size=16) as (base, _):
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": "Hello there", "max_tokens": 4,
                                                           "ignore_eos": True}).json()
        kept = httpx.get(f"{base}/v1/timelines", params={"id": [reply["id"], "unknown"]}).json()["timelines"]
        metrics = scrape(base)
    assert list(kept) == [reply["id"]]
    timeline = RequestTimeline.from_dict(kept[reply["id"]])
    assert [s.kind for s in timeline.spans] == ["prefill"] + ["decode"] * 3
    assert timeline.received <= timeline.arrival <= timeline.spans[0].start <= timeline.first_sent <= timeline.last_sent
    assert metrics['kvstrata_step_duration_seconds_count{model_name="SmolLM2-135M-Instruct"}'] >= 4


def test_timelines_and_kv_events_kept_are_bounded_and_their_fill_is_on_metrics(smollm2):
    """`--timelines-kept 2 --kv-events-kept 4`: the third request's timeline pushes out the first, the
    KV event ring holds its last 4 events; /metrics says how full the bounded stores are (a long run
    reads it to tell a store still filling from a leak)."""
    with running_server(smollm2, num_device_blocks=64, block_size=16, timelines_kept=2,
                        kv_events_kept=4) as (base, _):
        ids = [httpx.post(f"{base}/v1/completions", json={"prompt": f"Hello {i}. " * 12, "max_tokens": 2}).json()["id"]
               for i in range(3)]
        kept = httpx.get(f"{base}/v1/timelines", params={"id": ids}).json()["timelines"]
        metrics = scrape(base)
    assert sorted(kept) == sorted(ids[1:])
    assert metrics['kvstrata_bounded_store_entries{store="timelines"}'] == 2
    assert metrics['kvstrata_bounded_store_capacity{store="timelines"}'] == 2
    # 3 prompts of 3 full blocks each: 9 blocks stored, the ring keeps 4 of their events
    assert metrics['kvstrata_bounded_store_entries{store="kv_events"}'] == 4
    assert metrics['kvstrata_bounded_store_capacity{store="kv_events"}'] == 4
