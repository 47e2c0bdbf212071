"""1 prefill + 1 decode engine (`kvstrata router --pd-disaggregation`) against 2 colocated engines behind
the kv_aware router, on a mixed workload: long prompts arriving while long replies stream.

Both fleets: two `kvstrata serve` engines with one torch thread each (same cores per engine), one
fresh Redis as their store, the router in front, driven one after the other by `kvstrata bench serve`
on the same trace, once every engine has mapped its KV memory (`kvstrata_kv_unmapped_bytes`: a fresh
engine maps it while idle, and a step writing an unmapped page pays the fault):

    streams        --streams requests, a 200-token prompt each and a --stream-output-token reply,
                   arriving 0.25 s apart from t = 0
    long prompts   --long requests, a --long-len-token prompt each and an 8-token reply, arriving
                   --long-gap s apart from t = 1 s (while the streams decode)

It prints TTFT p50/p99, TPOT p99, ITL p99 and output throughput of both fleets and the ratios
(disaggregated / colocated) beside the issue's goals (TPOT p99 and ITL p99 <= 0.7x, TTFT p50
<= 1.3x), the handoffs the router counted, the CPU time each part of each fleet used, and the
machine's load before and after each run (timings on a shared machine mostly measure the
neighbours: take the quiet lock first).

Then the simulator's prediction for the same two fleets on the same trace (`kvstrata simulate
--pd-splits 1:1`, the engines' own defaults: block size, batch budget, --max-tpot-ms, KV memory;
the kv_aware router; steps and the store link from --profile, a 1-thread calibration of this
machine against Redis) beside the measured figures, with the relative error of each.
`--simulate-only DIR` redoes that comparison from a run's saved results in DIR.

Run: .venv/bin/python benchmarks/pd_disaggregation.py [--streams 8] [--long 6] [--long-len 1800]
     [--long-gap 2.0] [--stream-output 160] [--repeats 1] [--profile P] [--local-prefill-tokens N]
     .venv/bin/python benchmarks/pd_disaggregation.py --simulate-only /tmp/pd-disaggregation-XXXX
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from router_fleet import kvstrata, wait_ready

from kvstrata.bench.client import Target
from kvstrata.bench.loadgen import wait_mapped
from kvstrata.core.config import CacheConfig, SchedulerConfig
from kvstrata.sim.cost_model import CostModel

TRACE_BLOCK = 512
REDIS = Path(sys.executable).parent / "redis-server"
PROFILE = Path(__file__).parent / "profiles" / "cpu-2core-zen5-smollm2-redis.json"
KINDS = ("disaggregated", "colocated")
ROWS = (("TTFT p50 ms", "ttft_ms", "p50", 1.3), ("TTFT p99 ms", "ttft_ms", "p99", None),
        ("TPOT p99 ms", "tpot_ms", "p99", 0.7), ("ITL p99 ms", "itl_ms", "p99", 0.7),
        ("output tok/s", "output_throughput", None, None))
SIMULATED = {"ttft_ms": "ttft_s", "tpot_ms": "tpot_s", "itl_ms": "itl_s"}    # measured key -> simulator's


def write_trace(path: Path, streams: int, long: int, long_len: int, long_gap: float, stream_output: int,
                repeats: int = 1) -> None:
    """Mooncake lines: every prompt its own hash ids (no prefix sharing between requests); one copy per
    repeat, each with ids of its own and a minute after the last (`kvstrata bench serve --repeats` runs
    the trace's next slice each time, and the simulator replays them all)."""
    lines, next_id = [], 1
    span = 1000 + long * long_gap * 1000 + 60_000            # ms from one copy to the next

    def ids(length: int) -> list[int]:
        nonlocal next_id
        count = -(-length // TRACE_BLOCK)
        next_id += count
        return list(range(next_id - count, next_id))

    for copy in range(repeats):
        for s in range(streams):
            lines.append({"timestamp": int(copy * span + s * 250), "input_length": 200,
                          "output_length": stream_output, "hash_ids": ids(200)})
        for k in range(long):
            lines.append({"timestamp": int(copy * span + 1000 + k * long_gap * 1000), "input_length": long_len,
                          "output_length": 8, "hash_ids": ids(long_len)})
    lines.sort(key=lambda line: line["timestamp"])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def run_fleet(kind: str, trace: Path, requests: int, stream_output: int, out: Path, port: int, repeats: int,
              local_prefill_tokens: int = 0) -> dict:
    """Start Redis, the two engines and the router of one fleet; bench it; stop everything."""
    redis_port, engines = port + 10, [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
    store = f"redis://127.0.0.1:{redis_port}/0"
    with open(out / f"fleet-{kind}.log", "w") as logs:
        processes = [subprocess.Popen([str(REDIS), "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
                                      stdout=logs, stderr=subprocess.STDOUT)]
        roles = ("prefill", "decode") if kind == "disaggregated" else ("both", "both")
        for url, role in zip(engines, roles):
            processes.append(kvstrata("serve", "--port", url.rsplit(":", 1)[1], "--threads", "1", "--store", store,
                                      "--disaggregation-mode", role, "--log-level", "WARNING",
                                      stdout=logs, stderr=subprocess.STDOUT))
        if kind == "disaggregated":
            flags = ["--pd-disaggregation", "--prefill", engines[0], "--decode", engines[1],
                     "--local-prefill-tokens", str(local_prefill_tokens)]
        else:
            flags = ["--policy", "kv_aware", "--engine", engines[0], "--engine", engines[1]]
        processes.append(kvstrata("router", "--port", str(port), "--log-level", "WARNING", *flags,
                                  stdout=logs, stderr=subprocess.STDOUT))
        router = f"http://127.0.0.1:{port}"
        parts = ["redis", *roles, "router"]
        try:
            wait_ready(router, processes[1:])
            for url in engines:        # each engine's KV memory mapped (kvstrata.bench.loadgen.wait_mapped)
                asyncio.run(wait_mapped(Target(url, url)))
            load = os.getloadavg()[0]
            cpu_before = [cpu_seconds(process.pid) for process in processes]
            machine_before = machine_cpu()
            client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([sys.executable, "-m", "kvstrata", "bench", "serve", "--base-url", router, "--label", kind,
                            "--workload", f"trace:{trace}", "--output-len", str(stream_output),
                            "--num-requests", str(requests), "--repeats", str(repeats), "--warmup-requests", "2",
                            "--output", str(out / kind), "--no-progress", "--timeout", "600",
                            "--patience", "60"],     # each repeat once the last one's store writes are done
                           check=True, stdout=subprocess.DEVNULL)
            client = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = {f"{part}{i}": after - before for i, (part, process, before)
                   in enumerate(zip(parts, processes, cpu_before)) if (after := cpu_seconds(process.pid)) >= 0}
            cpu["client"] = client.ru_utime + client.ru_stime - client_before.ru_utime - client_before.ru_stime
            cpu.update({f"machine_{name}": after - before for name, after, before
                        in zip(("busy", "steal"), machine_cpu(), machine_before)})
            (summary,) = json.loads((out / f"{kind}.json").read_text())["summary"].values()
            metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(f"{router}/metrics").text.splitlines()
                       if re.match(r"kvstrata_router_(handoffs|handoff_fallbacks|handed_over_tokens)_total", line)}
            return {"summary": summary, "load": (load, os.getloadavg()[0]), "router": metrics, "cpu_s": cpu}
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=60)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process, all its threads (-1 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """CPU seconds of the whole machine so far: busy (every process, ours or a neighbour's) and stolen
    by the hypervisor (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def simulate(trace: Path, profile: Path, out: Path, local_prefill_tokens: int = 0,
             requests: int | None = None) -> dict[str, dict]:
    """`kvstrata simulate` of 1P+1D and 2 colocated engines on `trace` (its first `requests`: one repeat's
    copy, all alike), set up as the real fleets are: the engines' default block size, batch budget,
    step-time target and KV memory (1 thread: the profile)."""
    cache, scheduling = CacheConfig(), SchedulerConfig()
    block_bytes = CostModel.load(profile).block_bytes(cache.block_size)
    device_tokens = cache.kv_cache_memory // block_bytes * cache.block_size
    path = out / "simulated.json"
    subprocess.run([sys.executable, "-m", "kvstrata", "simulate", "--trace", str(trace), "--pd-splits", "1:1",
                    "--router", "kv_aware", "--store-cache-tokens", "inf", "--profile", str(profile),
                    "--block-size", str(cache.block_size), "--device-cache-tokens", str(device_tokens),
                    "--max-num-seqs", str(scheduling.max_num_seqs),
                    "--max-num-batched-tokens", str(scheduling.max_num_batched_tokens),
                    "--max-tpot-ms", str(scheduling.max_tpot_ms), "--local-prefill-tokens", str(local_prefill_tokens),
                    *(["--max-requests", str(requests)] if requests else []), "--output-json", str(path)],
                   check=True, stdout=subprocess.DEVNULL)
    layouts = json.loads(path.read_text())["layouts"]
    return dict(zip(KINDS, layouts))


def predicted(run: dict, key: str, stat: str | None) -> float:
    """A simulated figure in the benchmark's units (ms, output tok/s)."""
    if stat is None:
        return run["throughput_tok_s"]
    return run[SIMULATED[key]][stat] * 1000


def print_comparison(measured: dict[str, dict], simulated: dict[str, dict], profile: Path) -> None:
    """Each figure of both fleets, measured and simulated, with the simulator's relative error; the ratios too."""
    print(f"simulator (kvstrata simulate --pd-splits 1:1, profile {profile.name}): predicted against measured")
    print(f"{'':<14}" + "".join(f"{label:>33}" for label in ("1P+1D", "2 colocated", "ratio (1P+1D / 2 colocated)")))
    print(f"{'':<14}" + f"{'measured':>12}{'simulated':>11}{'error':>10}" * 3)
    errors = []
    for label, key, stat, _ in ROWS:
        real = [measured[kind][key] if stat is None else measured[kind][key][stat] for kind in KINDS]
        sim = [predicted(simulated[kind], key, stat) for kind in KINDS]
        real.append(real[0] / real[1])
        sim.append(sim[0] / sim[1])
        errors += [p / r - 1 for r, p in zip(real, sim)]
        print(f"{label:<14}" + "".join(f"{r:>12.2f}{p:>11.2f}{p / r - 1:>+10.1%}" for r, p in zip(real, sim)))
    print(f"within the goal of 10%: {sum(abs(e) <= 0.1 for e in errors)} of {len(errors)} "
          f"(fleets' figures {sum(abs(e) <= 0.1 for i, e in enumerate(errors) if i % 3 < 2)} of {len(ROWS) * 2})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long", type=int, default=6)
    parser.add_argument("--long-len", type=int, default=1800)
    parser.add_argument("--long-gap", type=float, default=2.0, help="seconds between long prompts")
    parser.add_argument("--stream-output", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--local-prefill-tokens", type=int, default=0,
                        help="the router's --local-prefill-tokens (and the simulator's): prompts the decode engine "
                             "lacks at most this many tokens of are prefilled there (default 0: all handed over)")
    parser.add_argument("--port", type=int, default=18300, help="router port; engines on the next two, Redis +10")
    parser.add_argument("--profile", type=Path, default=PROFILE, help="the simulator's calibrated profile")
    parser.add_argument("--simulate-only", type=Path, default=None, metavar="DIR",
                        help="no fleets: the simulator against the measured figures a run saved in DIR")
    args = parser.parse_args()
    if args.simulate_only is not None:
        measured = {kind: next(iter(json.loads((args.simulate_only / f"{kind}.json").read_text())["summary"].values()))
                    for kind in KINDS}
        print_comparison(measured, simulate(args.simulate_only / "mixed.jsonl", args.profile, args.simulate_only,
                                            args.local_prefill_tokens, args.streams + args.long), args.profile)
        return
    out = Path(tempfile.mkdtemp(prefix="pd-disaggregation-"))
    trace = out / "mixed.jsonl"
    write_trace(trace, args.streams, args.long, args.long_len, args.long_gap, args.stream_output, args.repeats)
    requests = args.streams + args.long
    print(f"{args.streams} streams (200 -> {args.stream_output} tokens) + {args.long} long prompts "
          f"({args.long_len} -> 8 tokens, every {args.long_gap}s); local prefill up to {args.local_prefill_tokens} "
          f"tokens; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; files in {out}")
    results = {kind: run_fleet(kind, trace, requests, args.stream_output, out, args.port, args.repeats,
                               args.local_prefill_tokens) for kind in KINDS}
    print(f"{'':<14} {'1P+1D':>10} {'2 colocated':>12} {'ratio':>7}   goal")
    for label, key, stat, goal in ROWS:
        pd, co = (results[kind]["summary"][key] if stat is None else results[kind]["summary"][key][stat]
                  for kind in KINDS)
        verdict = "" if goal is None else f"<= {goal}x: {'met' if pd <= goal * co else 'NOT met'}"
        print(f"{label:<14} {pd:>10.1f} {co:>12.1f} {pd / co:>7.2f}   {verdict}")
    for kind, result in results.items():
        failed = result["summary"].get("failed", 0)
        cpu = ", ".join(f"{part} {seconds:.1f}" for part, seconds in result["cpu_s"].items())
        fleet = sum(seconds for part, seconds in result["cpu_s"].items() if not part.startswith("machine_"))
        cpu += f" (the fleet {fleet:.1f}, so the neighbours {result['cpu_s']['machine_busy'] - fleet:.1f})"
        print(f"{kind}: load (1-min) {result['load'][0]:.1f} -> {result['load'][1]:.1f}; failed {failed}; "
              f"router: {result['router'] or '-'}; CPU s over {result['summary']['duration_s']:.1f} s: {cpu}")
    (out / "fleets.json").write_text(json.dumps(results, indent=2) + "\n")
    print_comparison({kind: result["summary"] for kind, result in results.items()},
                     simulate(trace, args.profile, out, args.local_prefill_tokens, requests), args.profile)


if __name__ == "__main__":
    main()
