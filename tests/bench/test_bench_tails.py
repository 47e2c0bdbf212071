"""`kvstrata bench serve`'s tails, goodput headline and load sweeps, against fake servers: an in-process
FastAPI app that streams completions (the third request of every eight waits before its first token,
the fifth between its tokens) and, like kvstrata, answers `/v1/timelines`, or, like a peer, does not."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
from fastapi import FastAPI, Query
from fastapi.responses import StreamingResponse

from kvstrata.bench import report
from kvstrata.bench.metrics import RequestResult, RunMetrics, parse_slo
from kvstrata.bench.tails import BREAKDOWN, Tails, slowest
from kvstrata.core.timeline import RequestTimeline, Span
from kvstrata.entrypoints.cli.main import main
from tests.entrypoints.server_helpers import serving

SLOW_TTFT, SLOW_DECODE = 0.5, 0.2     # seconds: before the first token of request 3 of 8, between tokens of request 5


def fake_server(timelines: bool) -> tuple[FastAPI, dict]:
    """The app, and what it did: {"ttft": [ids made slow to a first token], "e2e": [ids slow to decode]}."""
    app, seen = FastAPI(), {"count": 0, "ttft": [], "e2e": [], "kept": {}}

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "fake"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        number, seen["count"] = seen["count"] % 8, seen["count"] + 1
        request_id = f"cmpl-{seen['count']:04d}{'0' * 28}"
        kind = {2: "ttft", 4: "e2e"}.get(number, "other")
        seen.setdefault(kind, []).append(request_id)
        wait, gap = SLOW_TTFT if kind == "ttft" else 0.0, SLOW_DECODE if kind == "e2e" else 0.0

        async def stream():
            timeline = RequestTimeline(time.monotonic())
            timeline.received = timeline.arrival
            await asyncio.sleep(wait)                       # queued
            for index in range(body["max_tokens"]):
                start = time.monotonic()
                await asyncio.sleep(gap if index else 0.0)
                timeline.add(Span("prefill" if index == 0 else "decode", start, time.monotonic(), 1, 1))
                yield f"data: {json.dumps({'id': request_id, 'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'id': request_id, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            timeline.finished = timeline.last_sent = time.monotonic()
            seen["kept"][request_id] = timeline
        return StreamingResponse(stream(), media_type="text/event-stream")

    if timelines:
        @app.get("/v1/timelines")
        async def get_timelines(id: list[str] = Query(default_factory=list)):     # noqa: A002
            return {"timelines": {i: seen["kept"][i].as_dict() for i in id if i in seen["kept"]}}
    return app, seen


BENCH = ["--workload", "random", "--num-requests", "8", "--input-len", "8", "--output-len", "6",
         "--warmup-requests", "0", "--no-progress"]


def compare(out, *flags: str):
    """`kvstrata bench serve` over a fake server with timelines ("ours") and one without ("peer"):
    the exit code and what ours was asked."""
    ours, did = fake_server(timelines=True)
    peer, _ = fake_server(timelines=False)
    with serving(ours, ready="/v1/models") as base, serving(peer, ready="/v1/models") as other:
        code = main(["bench", "serve", "--base-url", base, "--compare-url", other, "--label", "ours",
                     "--label", "peer", *BENCH, *flags, "--output", str(out)])
    return code, did


def test_slowest_requests_with_their_breakdown_and_a_peer_without_timelines(tmp_path, capsys):
    out = tmp_path / "run"
    code, did = compare(out, "--request-rate", "inf", "--slo", "ttft=300")
    assert code == 0
    text = capsys.readouterr().out
    assert "ours: where the time went (s), the slowest 1 of 8 by e2e latency and 1 more by TTFT; " \
           "timelines of 8 requests" in text
    assert "peer: the server keeps no timelines" in text
    assert "all 8, mean" in text and "all 8, sum" in text and "decode_behind_prefill" in text
    # goodput heads the results: the request slow to its first token misses the SLO on both servers
    headline = next(line for line in text.splitlines() if line.startswith("headline: "))
    assert "ours " in headline and "goodput" in headline and "(88% of requests in SLO)" in headline
    assert "ours/peer throughput" in headline and "SLO ttft <= 300 ms" in headline
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["summary"]["ours"]["slo_fraction"] == pytest.approx(7 / 8)
    assert data["tails"]["peer"]["timelines"] is None and data["tails"]["peer"]["slowest"][0]["breakdown"] is None
    tails = data["tails"]["ours"]
    assert tails["timelines"] == 8 and tails["all"]["requests"] == 8
    by_e2e, by_ttft = tails["slowest"]
    assert (by_e2e["slowest_by"], by_e2e["request_id"]) == ("e2e", did["e2e"][0])
    assert (by_ttft["slowest_by"], by_ttft["request_id"]) == ("ttft", did["ttft"][0])
    assert by_e2e["breakdown"]["decode"] >= 5 * SLOW_DECODE - 0.01 and by_e2e["breakdown"]["queued"] < 0.1
    assert by_ttft["breakdown"]["queued"] >= SLOW_TTFT - 0.01
    assert by_ttft["timeline"]["spans"][0][0] == "prefill"
    assert tails["all"]["breakdown"]["queued"] >= SLOW_TTFT - 0.01
    for row in (by_e2e, by_ttft):     # the client's e2e is the server's account plus what happened outside it
        assert sum(row["breakdown"].values()) == pytest.approx(row["e2el"])
        assert -0.01 < row["breakdown"]["outside"] < row["e2el"]
    requests = [r for run in data["runs"] for r in run["requests"]]
    assert all(r["request_id"].startswith("cmpl-") for r in requests)


def test_no_timelines_flag_fetches_none(tmp_path, capsys):
    ours, _ = fake_server(timelines=True)
    with serving(ours, ready="/v1/models") as base:
        assert main(["bench", "serve", "--base-url", base, *BENCH, "--no-timelines",
                     "--output", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    assert "where the time went" not in text and "keeps no timelines" not in text
    assert "goodput needs an SLO" in text                 # and the table says goodput needs one
    assert "tails" not in json.loads((tmp_path / "run.json").read_text())


def test_a_sweep_runs_each_rate_and_summarizes(tmp_path, capsys):
    out = tmp_path / "sweep"
    code, did = compare(out, "--request-rate", "40,inf", "--slo", "ttft=300,tpot=1000")
    assert code == 0
    assert did["count"] == 16                                # the same 8 requests at each rate
    text = capsys.readouterr().out
    assert text.index("== request rate 40/s ==") < text.index("== request rate inf/s ==") < text.index("sweep of")
    assert text.count("headline: ") == 2
    summary = text[text.index("sweep of"):]
    assert "rate (/s)" in summary and "TTFT p99 ms" in summary and "goodput" in summary
    assert [line.split()[:2] for line in summary.splitlines()[2:-1]] == [
        ["40", "ours"], ["40", "peer"], ["40", "ours/peer"], ["inf", "ours"], ["inf", "peer"], ["inf", "ours/peer"]]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["config"]["request_rate"] == [40.0, "inf"]
    assert [point["request_rate"] for point in data["sweep"]] == [40.0, "inf"]
    for point in data["sweep"]:
        assert set(point["summary"]) == {"ours", "peer"} and point["tails"]["ours"]["timelines"] == 8
        assert [r["label"] for r in point["runs"]] == ["ours", "peer"]
        assert point["summary"]["ours"]["goodput"] < point["summary"]["ours"]["request_throughput"]
    rows = data["sweep_summary"]
    assert [(r["request_rate"], r["label"]) for r in rows][:3] == [(40.0, "ours"), (40.0, "peer"), (40.0, "ours/peer")]
    assert rows[0]["ttft_ms.p99"] > 250 and rows[0]["goodput"] > 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_rates_are_checked():
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--request-rate", "1,0"])
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--request-rate", "1,fast"])


# ---- the pieces, without a server -------------------------------------------------------------
def result(e2el: float, ttft: float, name: str, ok: bool = True) -> RequestResult:
    return RequestResult(ok=ok, prompt_tokens=10, output_tokens=5, ttft=ttft, e2el=e2el, request_id=name)


def test_slowest_one_percent_by_e2e_and_by_ttft_once_each():
    results = [result(1.0 + i / 1000, 0.1, f"r{i}") for i in range(250)]
    results[7].ttft = results[8].ttft = 0.9          # slow to start, not slow overall
    results[249].ttft = 1.0                          # slowest both ways: listed once, by e2e
    results.append(result(99.0, 99.0, "failed", ok=False))
    picked = [(r.request_id, by) for r, by in slowest(results)]
    assert picked == [("r249", "e2e"), ("r248", "e2e"), ("r247", "e2e"), ("r7", "ttft"), ("r8", "ttft")]
    assert [(r.request_id, by) for r, by in slowest(results[:3])] == [("r2", "e2e"), ("r0", "ttft")]
    assert slowest([]) == []


def timeline(queued: float, decode: float) -> dict:
    t = RequestTimeline(arrival=10.0, received=9.99)
    t.add(Span("prefill", 10.0 + queued, 10.01 + queued, 8, 8, 8))
    t.add(Span("decode", 10.01 + queued, 10.01 + queued + decode, 1, 4, 2))      # half the step is others' prefill
    t.finished = t.last_sent = 10.01 + queued + decode
    return t.as_dict()


def test_breakdown_table_rows_mean_and_sum():
    results = [result(0.5, 0.03, "slow"), result(0.45, 0.43, "a"), result(0.1, 0.02, "b"), result(0.2, 0.02, "gone")]
    kept = {"slow": timeline(0.0, 0.48), "a": timeline(0.4, 0.03), "b": timeline(0.0, 0.08)}
    tails = Tails.of("ours", results, kept)
    assert tails.timelines == 3 and [(s.request_id, s.slowest_by) for s in tails.slow] == [("slow", "e2e"),
                                                                                            ("a", "ttft")]
    slow = tails.slow[0].breakdown
    assert slow["queued"] == 0 and slow["decode"] == pytest.approx(0.24) and slow["prefill"] == pytest.approx(0.01)
    assert slow["decode_behind_prefill"] == pytest.approx(0.24) and slow["before_engine"] == pytest.approx(0.01)
    assert slow["outside"] == pytest.approx(0.0, abs=1e-9)         # the client saw what the server accounts for
    assert tails.slow[1].breakdown["queued"] == pytest.approx(0.4)
    assert tails.total["queued"] == pytest.approx(0.4) and tails.total_e2el == pytest.approx(1.05)
    lines = tails.table().splitlines()
    assert lines[1].split() == ["request", "slowest", "by", "e2e", "TTFT", "outside", *BREAKDOWN]
    assert lines[2].split()[:8] == ["slow", "e2e", "0.500", "0.030", "0.000", "0.010", "0.000", "0.000"]
    assert lines[-2].split()[:5] == ["all", "3,", "mean", "0.350", "0.160"]
    assert lines[-1].split()[:4] == ["all", "3,", "sum", "1.050"]
    missing = Tails.of("ours", results, {"a": kept["a"]})        # the slowest one's timeline was pushed out
    assert "not kept" in missing.table().splitlines()[2]
    assert Tails.of("peer", results, None).table() == "peer: the server keeps no timelines (no breakdown of " \
                                                      "its slowest requests)"


def test_headline_and_table_without_an_slo_say_goodput_needs_one():
    results = [result(1.0, 0.1, "a"), result(1.0, 0.5, "b")]
    with_slo = {"x": RunMetrics.of(results, 2.0, parse_slo("ttft=200")), "y": RunMetrics.of(results[:1], 2.0, {})}
    line = report.headline(with_slo, parse_slo("ttft=200"))
    assert line.startswith("headline: x 1.000 requests/s (5.000 output tok/s), goodput 0.500 requests/s (50% of")
    assert "x/y throughput 2.00x, goodput 1.00x. SLO ttft <= 200 ms" in line
    without = {"x": RunMetrics.of(results, 2.0, {})}
    assert report.headline(without, {}).endswith("goodput needs an SLO (--slo ttft=2000,tpot=250, milliseconds)")
    rows = {line.split("  ")[0]: line for line in report.table(without).splitlines()}
    assert rows["goodput (requests/s in SLO)"].endswith("needs --slo")
    assert "requests in SLO (share)" in report.table(with_slo)
    assert math.isnan(RunMetrics.of([], 1.0, parse_slo("ttft=1")).slo_fraction)
