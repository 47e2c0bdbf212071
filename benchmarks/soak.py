"""The long haul: N minutes of mixed traffic and every fault at once, against a fleet and a P/D pair.

    .venv/bin/python benchmarks/soak.py --minutes 30 --max-rss-slope 1    # the benchmark (BENCHMARKS.md)
    .venv/bin/python benchmarks/soak.py --minutes 2                       # the slow suite's version

Starts Redis, two engines sharing it behind `kvstrata router`, and a prefill + decode pair sharing a
disk store behind `kvstrata router --pd-disaggregation` (soak_fleet.py; every engine with
`--batch-invariant --audit-every-step`, ngram speculative decoding, a small device pool and host tier,
`--max-queue 12`). Drives the seeded mixed traffic of soak_traffic.py at both routers, with bursts
past the queue, while soak_faults.py applies its schedule: Redis killed and restarted, an engine
SIGKILLed and restarted, the decode engine killed mid-handoff, records corrupted in Redis and on disk,
the disk store filled and made read-only. Every minute it prints requests by outcome and each
process's resident memory (sampled every `--sample-every` s). At the end, with the traffic stopped:
blocks held on every engine (0 used, 0 in flight), the engines' audit failures, every engine alive,
greedy probes asked alone before, under load, and after (equal, under --batch-invariant), and the
resident-memory slope of each process after the warm-up (soak_faults.WARMUP of the run: every
restart is over and the tiers are full). Writes soak.json and soak-rss.png into `--out`; exits 1
when any of these fails (the slope only when `--max-rss-slope` is given).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from soak_faults import SCHEDULE, WARMUP, Faults, Window
from soak_fleet import Fleet, Process, Sizes
from soak_traffic import EXPECTED_4XX, MODEL, Outcome, Traffic

logger = logging.getLogger("soak")
PROBES = ["The three oldest families of the harbour were", "A ledger of 1623 lists", "Maps of the coast show"]
TAKEN_OUT = re.compile(r"^(\S+ \S+) WARNING kvstrata\.router\.fleet: engine (\S+) taken out: (.*)$")
BACK_IN = re.compile(r"^(\S+ \S+) INFO kvstrata\.router\.fleet: engine (\S+) is in ")
BOUNDED_STORES = ("timelines", "kv_events")     # an engine's bounded stores: entries kept / capacity, sampled
GRACE_S = 10.0                 # after a fault's window, failures are still its own (retries, health checks)


def probe(fleet: Fleet) -> dict[str, list[str]]:
    """Greedy answers of PROBES through each router, asked one at a time (retried across a brief outage)."""
    answers: dict[str, list[str]] = {}
    for target, url in (("fleet", fleet.fleet_router), ("pd", fleet.pd_router)):
        answers[target] = []
        for prompt in PROBES:
            for attempt in range(5):
                try:
                    reply = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                      "max_tokens": 24, "temperature": 0},
                                       timeout=300)
                    if reply.status_code == 200:
                        answers[target].append(reply.json()["choices"][0]["text"])
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(2 + attempt * 3)
            else:
                answers[target].append("<no answer>")
    return answers


def sample(processes: dict[str, Process], origin: float, every_s: float, stop: threading.Event,
           samples: list[dict]) -> None:
    """Resident memory of every live process every `every_s` until `stop`; for the engines also malloc's
    bytes in use and free and Python's allocated blocks (their /metrics), to tell what kind of growth it is."""
    while True:
        now = time.time() - origin
        for process in processes.values():
            rss = process.rss_mib()
            if rss is None:
                continue
            point = {"t": round(now, 1), "process": process.name, "incarnation": process.incarnation,
                     "rss_mib": round(rss, 1)}
            if process.name in Fleet.ENGINES and (metrics := process.metrics()):
                point.update(heap_in_use_mib=round(metrics.get('kvstrata_heap_bytes{kind="in_use"}', 0) / 2**20, 1),
                             heap_free_mib=round(metrics.get('kvstrata_heap_bytes{kind="free"}', 0) / 2**20, 1),
                             python_blocks=metrics.get("kvstrata_python_allocated_blocks", 0),
                             stores=store_fill(metrics))
            samples.append(point)
        if stop.wait(every_s):
            return


def store_fill(metrics: dict[str, float]) -> dict[str, list[int]]:
    """[entries kept, capacity] of each bounded store, from an engine's /metrics."""
    sample = lambda kind, store: int(metrics.get(f'kvstrata_bounded_store_{kind}{{store="{store}"}}', 0))  # noqa: E731
    return {store: [sample("entries", store), sample("capacity", store)] for store in BOUNDED_STORES}


def full_since(samples: list[dict], name: str) -> dict[str, float | None]:
    """When each bounded store of an engine's last incarnation was first seen full (None: never)."""
    own = [s for s in samples if s["process"] == name and "stores" in s]
    own = [s for s in own if s["incarnation"] == own[-1]["incarnation"]] if own else []
    return {store: next((s["t"] for s in own if 0 < s["stores"][store][1] <= s["stores"][store][0]), None)
            for store in BOUNDED_STORES}


def classify(outcome: Outcome, windows: list[Window], queue_full: list[tuple[float, float]] = ()) -> str:
    """What an outcome counts as: answered, cut/hung up on purpose, 4xx by kind, 503 by queue, or a failure
    attributed to the fault whose window (plus GRACE_S) it overlaps, else 'unexplained'.

    A router answers 503 "no engine is available" while every engine behind it is out, and it takes out
    an engine that answered 503 at capacity until a health check brings it back in: within `queue_full` (a
    burst past the queue, or an engine out for its 503 until it was back in, plus GRACE_S) that is a 503 by
    queue."""
    if outcome.kind in EXPECTED_4XX and outcome.status == EXPECTED_4XX[outcome.kind]:
        return f"4xx {outcome.kind[4:]}"
    if outcome.kind not in EXPECTED_4XX and outcome.status == 200 and outcome.error in ("", "cut"):
        return {"cut": "cut on purpose"}.get(outcome.kind, "answered")
    if outcome.kind == "hangup" and outcome.error == "hung up":
        return "hung up on purpose"
    # any request, bad ones too: a router with every engine out answers 503 before it reads the body
    if outcome.status == 503 and ("at capacity" in outcome.error or "no engine is available" in outcome.error):
        if "at capacity" in outcome.error or outcome.kind == "burst" or any(
                outcome.start <= end + GRACE_S and outcome.end >= start for start, end in queue_full):
            return "503 queue"
    for window in windows:
        end = (window.end or time.time()) + GRACE_S
        if outcome.start <= end and outcome.end >= window.start:
            return f"failed in {window.fault}"
    return "unexplained " + (f"{outcome.status}" if outcome.status else outcome.error.split(":")[0])


def take_outs(logs: list[Path], until: float) -> list[tuple[float, float, str, str]]:
    """(taken out, back in or `until`, engine, reason) of each time a router took an engine out, from the
    routers' logs (wall-clock times)."""
    found = []
    for log in logs:
        out: dict[str, tuple[float, str]] = {}
        for line in log.read_text(errors="replace").splitlines():
            if match := TAKEN_OUT.match(line) or BACK_IN.match(line):
                when = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                if match.re is TAKEN_OUT:
                    out[match.group(2)] = (when, match.group(3))
                elif match.group(2) in out:
                    since, reason = out.pop(match.group(2))
                    found.append((since, when, match.group(2), reason))
        found += [(since, until, url, reason) for url, (since, reason) in out.items()]
    return sorted(found)


def slope(samples: list[dict], name: str, after_s: float, key: str = "rss_mib") -> dict | None:
    """Growth per minute of `key` in `name`'s last incarnation over its samples after `after_s` (least squares)."""
    own = [s for s in samples if s["process"] == name and key in s]
    if not own:
        return None
    last = max(s["incarnation"] for s in own)
    points = [(s["t"], s[key]) for s in own if s["incarnation"] == last and s["t"] >= after_s]
    if len(points) < 3:
        return None
    t, values = np.array(points).T
    per_minute = float(np.polyfit(t / 60, values, 1)[0])
    return {"per_min": round(per_minute, 2), "first": values[0], "last": values[-1], "samples": len(points),
            "incarnation": last}


def at_rest(engine: Process, timeout_s: float = 180.0) -> dict:
    """Once the engine has no request and no block in flight: its blocks by tier/state and its counters."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = engine.metrics()
        busy = sum(v for k, v in metrics.items() if k.startswith("kvstrata_requests{")
                   or (k.startswith("kvstrata_kv_blocks{") and 'state="in_flight"' in k))
        if (metrics and busy == 0) or time.monotonic() > deadline:
            break
        time.sleep(1)
    held = {k: int(v) for k, v in metrics.items() if k.startswith("kvstrata_kv_blocks{") and v
            and ('state="used"' in k or 'state="in_flight"' in k)}
    pick = lambda prefix: {k: int(v) for k, v in metrics.items() if k.startswith(prefix) and v}  # noqa: E731
    return {"answers": bool(metrics), "held": held, "audit_failures": int(metrics.get("kvstrata_audit_failures_total",
                                                                                      -1)),
            "step_failures": int(metrics.get("kvstrata_step_failures_total", -1)),
            "load_failures": pick("kvstrata_load_failures"), "store_errors": pick("kvstrata_store_errors"),
            "prompt_tokens": pick("kvstrata_prompt_tokens"), "incarnations": engine.incarnation}


async def drive(fleet: Fleet, args: argparse.Namespace, origin: float, windows: list[Window],
                samples: list[dict]) -> tuple[Traffic, list[dict]]:
    """The traffic for args.minutes, probes under load at 45% and 85% of it, a line of figures every minute."""
    duration = args.minutes * 60
    traffic = Traffic({"fleet": fleet.fleet_router, "pd": fleet.pd_router}, args.seed)
    tasks = [asyncio.create_task(traffic.client(i, "fleet" if i % 3 else "pd")) for i in range(args.clients)]
    tasks.append(asyncio.create_task(traffic.bursts(every_s=max(20.0, duration / 12), size=3 * fleet.sizes.max_queue)))
    during: list[dict] = []
    next_report, probe_at = origin + 60, [origin + 0.45 * duration, origin + 0.85 * duration]
    while (now := time.time()) < origin + duration:
        if probe_at and now >= probe_at[0]:
            probe_at.pop(0)
            during.append(await asyncio.to_thread(probe, fleet))
        if now >= next_report:
            next_report += 60
            counts = Counter(classify(o, windows, traffic.bursts_at) for o in traffic.outcomes)
            rss = {s["process"]: s["rss_mib"] for s in samples}
            logger.info("%4.0f s: %d requests %s | RSS MiB %s", now - origin, len(traffic.outcomes),
                        dict(counts.most_common()), {k: round(v) for k, v in rss.items()})
        await asyncio.sleep(1)
    traffic.stop.set()
    await asyncio.gather(*tasks)
    return traffic, during


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients (a third at the P/D router)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds between memory samples")
    parser.add_argument("--max-rss-slope", type=float, default=None,
                        help="fail when an engine's resident memory grows faster (MiB/min) after the warm-up")
    parser.add_argument("--port", type=int, default=18700, help="the fleet's router; the rest on the next ports")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = args.out or Path(tempfile.mkdtemp(prefix="kvstrata-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    fleet = Fleet.plan(out, args.port, Sizes())
    logger.info("starting the fleet (logs in %s)", out)
    fleet.start()
    before = probe(fleet)
    origin, duration = time.time(), args.minutes * 60
    stop, samples = threading.Event(), []
    faults = Faults(fleet, duration, args.seed)
    threads = [threading.Thread(target=sample, args=(fleet.processes, origin, args.sample_every, stop, samples)),
               threading.Thread(target=faults.run, args=(origin, stop))]
    for thread in threads:
        thread.start()
    logger.info("%g min of traffic from %d clients, faults: %s", args.minutes, args.clients,
                ", ".join(f"{f.name} at {f.at:.0%}" for f in SCHEDULE))
    try:
        traffic, during = asyncio.run(drive(fleet, args, origin, faults.windows, samples))
        traffic_s = time.time() - origin
        rest = {engine.name: at_rest(engine) for engine in fleet.engines()}
        after = probe(fleet)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        exits = fleet.stop()
    report = summarize(args, fleet, traffic, faults.windows, samples, rest, [before, *during, after], origin, traffic_s,
                       exits)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    plot(samples, duration * WARMUP, out / "soak-rss.png")
    print_report(report, out)
    return 0 if report["ok"] else 1


def summarize(args, fleet, traffic, windows, samples, rest, probes, origin, traffic_s, exits) -> dict:
    outcomes = traffic.outcomes
    taken_out = take_outs([fleet.processes[name].log for name in ("router", "pd-router")], time.time())
    queue_full = traffic.bursts_at + [(since, back) for since, back, _, reason in taken_out
                                      if reason == "it answered 503"]
    by_cause = Counter(classify(o, windows, queue_full) for o in outcomes)
    examples: dict[str, list[str]] = {}
    for outcome in outcomes:
        seen = examples.setdefault(classify(outcome, windows, queue_full), [])
        what = f"{outcome.start - origin:.1f} s {outcome.target} {outcome.kind} {outcome.status}: {outcome.error[:100]}"
        if outcome.error and len(seen) < 4 and what not in seen:
            seen.append(what)
    per_fault = {}
    for w in windows:
        end = (w.end or w.start) + GRACE_S
        inside = Counter(classify(o, [w], queue_full) for o in outcomes if o.start <= end and o.end >= w.start)
        per_fault[w.fault] = {"start_s": round(w.start - origin, 1), "end_s": round(end - GRACE_S - origin, 1),
                              "detail": w.detail, "requests": dict(inside.most_common())}
    warmup = args.minutes * 60 * WARMUP
    slopes = {name: slope(samples, name, warmup) for name in ("redis", *Fleet.ENGINES, "router", "pd-router")}
    inside = {name: {key: slope(samples, name, warmup, key) for key in ("heap_in_use_mib", "heap_free_mib",
                                                                        "python_blocks")} for name in Fleet.ENGINES}
    unexplained = {k: n for k, n in by_cause.items() if k.startswith("unexplained")}
    changed = [i for i, answers in enumerate(probes[1:], 1) if answers != probes[0]]
    checks = {"nothing held at rest": all(not r["held"] and r["answers"] for r in rest.values()),
              "0 audit failures": all(r["audit_failures"] == 0 for r in rest.values()),
              "0 unexplained failures": not unexplained,
              "every fault applied": len(windows) == len(SCHEDULE) and not any("error" in w.detail for w in windows),
              "probes unchanged": not changed and "<no answer>" not in str(probes)}
    if args.max_rss_slope is not None:
        checks[f"engine RSS slope < {args.max_rss_slope} MiB/min"] = all(
            slopes[name] and slopes[name]["per_min"] < args.max_rss_slope for name in Fleet.ENGINES)
    return {"minutes": args.minutes, "traffic_s": round(traffic_s, 1), "seed": args.seed, "clients": args.clients,
            "requests": len(outcomes), "bursts": [round(start - origin, 1) for start, _ in traffic.bursts_at],
            "router_take_outs": dict(Counter(reason.split(":")[0] for _, _, _, reason in taken_out)),
            "router_take_out_times": [(round(since - origin, 1), round(back - origin, 1), url, reason[:80])
                                      for since, back, url, reason in taken_out],
            "by_cause": dict(by_cause.most_common()), "examples": examples, "faults": per_fault,
            "at_rest": rest, "rss_slope": slopes,
            "stores_full_since_s": {name: full_since(samples, name) for name in Fleet.ENGINES}, "engine_memory_slope": inside, "warmup_s": warmup, "probes": probes,
            "probes_changed": changed, "exit_codes": exits, "checks": checks, "ok": all(checks.values()),
            "rss_samples": samples}


def plot(samples: list[dict], warmup_s: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(9, 5))
    for name in dict.fromkeys(s["process"] for s in samples):
        own = [s for s in samples if s["process"] == name]
        for incarnation in sorted({s["incarnation"] for s in own}):
            points = [(s["t"] / 60, s["rss_mib"]) for s in own if s["incarnation"] == incarnation]
            axes.plot(*zip(*points), label=name if incarnation == 1 else None,
                      color=f"C{list(Fleet.ENGINES + ('redis', 'router', 'pd-router')).index(name)}")
    axes.axvline(warmup_s / 60, color="grey", linestyle="--", label="end of warm-up")
    axes.set_xlabel("minutes")
    axes.set_ylabel("resident memory, MiB")
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def print_report(report: dict, out: Path) -> None:
    print(f"\n{report['requests']} requests in {report['traffic_s']:.0f} s, by outcome:")
    for cause, n in report["by_cause"].items():
        print(f"  {n:>6}  {cause}")
        if cause.startswith("unexplained"):
            print("".join(f"            {example}\n" for example in report["examples"][cause]), end="")
    print(f"routers took an engine out: {report['router_take_outs']} ({len(report['bursts'])} bursts past the queue)")
    print("faults (requests overlapping each window):")
    for name, fault in report["faults"].items():
        print(f"  {name:<24} {fault['start_s']:>6.0f}-{fault['end_s']:<6.0f} s  {fault['requests']}  {fault['detail']}")
    print("at rest:")
    for name, rest in report["at_rest"].items():
        print(f"  {name:<8} held {rest['held'] or 0}  audit failures {rest['audit_failures']}  "
              f"incarnations {rest['incarnations']}  load failures {rest['load_failures']}")
    print(f"resident memory after {report['warmup_s'] / 60:.0f} min (MiB/min, first -> last):")
    for name, fitted in report["rss_slope"].items():
        if fitted:
            inside = report["engine_memory_slope"].get(name, {})
            parts = [f"{key} {inside[key]['per_min']:+.2f}/min ({inside[key]['first']:.0f} -> "
                     f"{inside[key]['last']:.0f})" for key in ("heap_in_use_mib", "heap_free_mib", "python_blocks") if inside.get(key)]
            print(f"  {name:<9} {fitted['per_min']:+6.2f}   {fitted['first']:.0f} -> {fitted['last']:.0f}"
                  f"  ({fitted['samples']} samples)  {'; '.join(parts)}")
    print("bounded stores first seen full (s; last incarnation): " + "; ".join(
        f"{name} " + ", ".join(f"{store} {'never' if t is None else f'{t:.0f}'}" for store, t in stores.items())
        for name, stores in report["stores_full_since_s"].items()))
    print(f"probes: {len(report['probes'])} rounds, changed rounds: {report['probes_changed'] or 'none'}")
    for check, passed in report["checks"].items():
        print(f"  {'ok  ' if passed else 'FAIL'} {check}")
    print(f"RESULT: {'ok' if report['ok'] else 'FAILED'}; {out / 'soak.json'}, {out / 'soak-rss.png'}")


if __name__ == "__main__":
    sys.exit(main())
