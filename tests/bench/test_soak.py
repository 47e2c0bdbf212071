"""The long-haul soak (benchmarks/soak.py): its classification of outcomes, and (slow) two real minutes of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.append(str(BENCHMARKS))

from soak import classify, full_since, slope, store_fill, take_outs  # noqa: E402
from soak_faults import SCHEDULE, Window  # noqa: E402
from soak_traffic import Outcome  # noqa: E402


def test_an_outcome_counts_as_what_the_client_meant_or_as_the_fault_whose_window_it_overlaps():
    window = Window("redis-kill", start=100.0, end=110.0)
    assert classify(Outcome("chat", "fleet", 1, 2, 200), [window]) == "answered"
    assert classify(Outcome("cut", "fleet", 1, 2, 200, "cut"), [window]) == "cut on purpose"
    assert classify(Outcome("hangup", "pd", 1, 2, None, "hung up"), [window]) == "hung up on purpose"
    assert classify(Outcome("bad-model", "pd", 1, 2, 404), []) == "4xx model"
    assert classify(Outcome("burst", "fleet", 1, 2, 503, "the server is at capacity (12 ...)"), []) == "503 queue"
    # a wrong status for bad input is no excuse, nor is a 5xx outside every window (plus its grace)
    assert classify(Outcome("bad-model", "pd", 1, 2, 200), []) == "unexplained 200"
    assert classify(Outcome("chat", "fleet", 50, 60, 500, "boom"), [window]) == "unexplained 500"
    assert classify(Outcome("chat", "fleet", 115, 116, 502), [window]) == "failed in redis-kill"
    assert classify(Outcome("chat", "fleet", 90, 101, None, "transport: ReadError"), [window]) == "failed in redis-kill"
    assert classify(Outcome("chat", "fleet", 130, 131, None, "transport: ReadError"), [window]).startswith("unexpl")
    # a router with every engine out answers "no engine": by queue while its engines were at capacity
    no_engine = Outcome("chat", "fleet", 300, 301, 503, '{"error":{"message":"no engine is available; retry later"')
    assert classify(no_engine, [window], queue_full=[(295.0, 295.0)]) == "503 queue"
    assert classify(no_engine, [window], queue_full=[(200.0, 210.0)]) == "unexplained 503"
    # bad input too: the router answers "no engine" before any engine reads the body
    bad_json = Outcome("bad-json", "fleet", 151.1, 151.2, 503, no_engine.error)
    assert classify(bad_json, [], queue_full=[(150.6, 151.6)]) == "503 queue"
    assert classify(bad_json, [], queue_full=[(100.0, 101.0)]) == "unexplained 503"


def test_an_engine_is_out_from_its_take_out_to_its_return_or_the_end_of_the_run(tmp_path):
    log = tmp_path / "router.log"
    log.write_text("2026-12-05 10:00:00,000 WARNING kvstrata.router.fleet: engine http://a taken out: it answered 503\n"
                   "2026-12-05 10:00:01,000 INFO kvstrata.router.fleet: engine http://b is in (0 cached blocks)\n"
                   "2026-12-05 10:00:14,500 INFO kvstrata.router.fleet: engine http://a is in (3 cached blocks)\n"
                   "2026-12-05 10:00:20,000 WARNING kvstrata.router.fleet: engine http://b taken out: ReadError: x\n")
    (a, b) = take_outs([log], until=1e12)
    assert a[1] - a[0] == pytest.approx(14.5) and a[2:] == ("http://a", "it answered 503")
    assert b[1] == 1e12 and b[2:] == ("http://b", "ReadError: x")      # never back: out to the end


def test_the_memory_slope_is_fitted_on_the_last_incarnation_after_the_warm_up():
    samples = [{"t": t, "process": "e", "incarnation": 1, "rss_mib": 100 + t} for t in range(0, 600, 30)]
    samples += [{"t": t, "process": "e", "incarnation": 2, "rss_mib": 500.0} for t in range(600, 1200, 30)]
    assert slope(samples, "e", after_s=0)["per_min"] == 0.0          # the restarted process is flat
    assert slope(samples[:20], "e", after_s=300)["per_min"] == pytest.approx(60.0)   # 1 MiB a second
    assert slope(samples, "e", after_s=1190) is None                      # too few samples to say


def test_a_bounded_store_is_full_from_its_first_full_sample_of_the_last_incarnation():
    metrics = {'kvstrata_bounded_store_entries{store="timelines"}': 256.0,
               'kvstrata_bounded_store_capacity{store="timelines"}': 256.0,
               'kvstrata_bounded_store_entries{store="kv_events"}': 10.0,
               'kvstrata_bounded_store_capacity{store="kv_events"}': 65536.0}
    assert store_fill(metrics) == {"timelines": [256, 256], "kv_events": [10, 65536]}
    full, filling = store_fill(metrics), {"timelines": [3, 256], "kv_events": [10, 65536]}
    samples = [{"t": 30, "process": "e", "incarnation": 1, "stores": full},
               {"t": 60, "process": "e", "incarnation": 2, "stores": filling},
               {"t": 90, "process": "e", "incarnation": 2, "stores": full},
               {"t": 120, "process": "e", "incarnation": 2, "stores": full}]
    assert full_since(samples, "e") == {"timelines": 90, "kv_events": None}
    assert full_since(samples, "other") == {"timelines": None, "kv_events": None}


@pytest.mark.slow      # ~5 min: six processes and Redis start, two minutes of traffic and faults, the fleet stops
def test_two_minutes_of_mixed_traffic_under_every_fault_leave_nothing_held_and_the_probes_unchanged(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "soak.py"), "--minutes", "2", "--sample-every", "10",
                           "--port", "18920", "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    assert (tmp_path / "soak.json").exists(), done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert all(report["checks"].values()) and (tmp_path / "soak-rss.png").stat().st_size > 0
    # it reached what it claims: every fault applied, with traffic in its window; every kind of outcome seen
    assert list(report["faults"]) == [fault.name for fault in SCHEDULE]
    assert all(sum(fault["requests"].values()) > 0 for fault in report["faults"].values()), report["faults"]
    corruption = report["faults"]["store-corruption"]["detail"]
    assert corruption["redis_records"] > 0 and corruption["disk_records"] > 0
    full = report["faults"]["disk-full-read-only"]["detail"]     # full when frozen, by junk or by traffic
    assert full["store_mib"] >= full["budget_mib"] - 1 > 0, full
    for cause in ("answered", "cut on purpose", "4xx oversized", "4xx json", "4xx model", "503 queue"):
        assert report["by_cause"].get(cause, 0) > 0, (cause, report["by_cause"])
    assert report["at_rest"]["engine1"]["incarnations"] == 2 and report["at_rest"]["decode"]["incarnations"] == 2
    assert len(report["probes"]) == 4 and not report["probes_changed"]
