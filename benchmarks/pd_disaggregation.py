"""1 prefill + 1 decode engine (`kvstrata router --pd-disaggregation`) against 2 colocated engines behind
the kv_aware router, on a mixed workload: long prompts arriving while long replies stream.

Both fleets: two `kvstrata serve` engines with one torch thread each (same cores per engine), one
fresh Redis as their store, the router in front, driven one after the other by `kvstrata bench serve`
on the same trace:

    streams        --streams requests, a 200-token prompt each and a --stream-output-token reply,
                   arriving 0.25 s apart from t = 0
    long prompts   --long requests, a --long-len-token prompt each and an 8-token reply, arriving
                   --long-gap s apart from t = 1 s (while the streams decode)

It prints TTFT p50/p99, TPOT p99, ITL p99 and output throughput of both fleets and the ratios
(disaggregated / colocated) beside the issue's goals (TPOT p99 and ITL p99 <= 0.7x, TTFT p50
<= 1.3x), the handoffs the router counted, and the machine's load before and after each run
(timings on a shared machine mostly measure the neighbours: take the quiet lock first).

Run: .venv/bin/python benchmarks/pd_disaggregation.py [--streams 8] [--long 6] [--long-len 1800]
     [--long-gap 2.0] [--stream-output 160] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from router_fleet import kvstrata, wait_ready

TRACE_BLOCK = 512
REDIS = Path(sys.executable).parent / "redis-server"


def write_trace(path: Path, streams: int, long: int, long_len: int, long_gap: float, stream_output: int) -> None:
    """Mooncake lines: every prompt its own hash ids (no prefix sharing between requests)."""
    lines, next_id = [], 1

    def ids(length: int) -> list[int]:
        nonlocal next_id
        count = -(-length // TRACE_BLOCK)
        next_id += count
        return list(range(next_id - count, next_id))

    for s in range(streams):
        lines.append({"timestamp": int(s * 250), "input_length": 200, "output_length": stream_output,
                      "hash_ids": ids(200)})
    for k in range(long):
        lines.append({"timestamp": int(1000 + k * long_gap * 1000), "input_length": long_len, "output_length": 8,
                      "hash_ids": ids(long_len)})
    lines.sort(key=lambda line: line["timestamp"])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def run_fleet(kind: str, trace: Path, requests: int, stream_output: int, out: Path, port: int, repeats: int) -> dict:
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
            flags = ["--pd-disaggregation", "--prefill", engines[0], "--decode", engines[1]]
        else:
            flags = ["--policy", "kv_aware", "--engine", engines[0], "--engine", engines[1]]
        processes.append(kvstrata("router", "--port", str(port), "--log-level", "WARNING", *flags,
                                  stdout=logs, stderr=subprocess.STDOUT))
        router = f"http://127.0.0.1:{port}"
        try:
            wait_ready(router, processes[1:])
            load = os.getloadavg()[0]
            subprocess.run([sys.executable, "-m", "kvstrata", "bench", "serve", "--base-url", router, "--label", kind,
                            "--workload", f"trace:{trace}", "--output-len", str(stream_output),
                            "--num-requests", str(requests), "--repeats", str(repeats), "--warmup-requests", "2",
                            "--output", str(out / kind), "--no-progress", "--timeout", "600"],
                           check=True, stdout=subprocess.DEVNULL)
            (summary,) = json.loads((out / f"{kind}.json").read_text())["summary"].values()
            metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(f"{router}/metrics").text.splitlines()
                       if re.match(r"kvstrata_router_(handoffs|handoff_fallbacks|handed_over_tokens)_total", line)}
            return {"summary": summary, "load": (load, os.getloadavg()[0]), "router": metrics}
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long", type=int, default=6)
    parser.add_argument("--long-len", type=int, default=1800)
    parser.add_argument("--long-gap", type=float, default=2.0, help="seconds between long prompts")
    parser.add_argument("--stream-output", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--port", type=int, default=18300, help="router port; engines on the next two, Redis +10")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="pd-disaggregation-"))
    trace = out / "mixed.jsonl"
    write_trace(trace, args.streams, args.long, args.long_len, args.long_gap, args.stream_output)
    requests = args.streams + args.long
    print(f"{args.streams} streams (200 -> {args.stream_output} tokens) + {args.long} long prompts "
          f"({args.long_len} -> 8 tokens, every {args.long_gap}s); {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; files in {out}")
    results = {kind: run_fleet(kind, trace, requests, args.stream_output, out, args.port, args.repeats)
               for kind in ("disaggregated", "colocated")}
    rows = (("TTFT p50 ms", "ttft_ms", "p50", 1.3), ("TTFT p99 ms", "ttft_ms", "p99", None),
            ("TPOT p99 ms", "tpot_ms", "p99", 0.7), ("ITL p99 ms", "itl_ms", "p99", 0.7))
    print(f"{'':<14} {'1P+1D':>10} {'2 colocated':>12} {'ratio':>7}   goal")
    for label, key, stat, goal in rows:
        pd, co = (results[kind]["summary"][key][stat] for kind in ("disaggregated", "colocated"))
        verdict = "" if goal is None else f"<= {goal}x: {'met' if pd <= goal * co else 'NOT met'}"
        print(f"{label:<14} {pd:>10.1f} {co:>12.1f} {pd / co:>7.2f}   {verdict}")
    pd, co = (results[kind]["summary"]["output_throughput"] for kind in ("disaggregated", "colocated"))
    print(f"{'output tok/s':<14} {pd:>10.1f} {co:>12.1f} {pd / co:>7.2f}")
    for kind, result in results.items():
        failed = result["summary"].get("failed", 0)
        print(f"{kind}: load (1-min) {result['load'][0]:.1f} -> {result['load'][1]:.1f}; failed {failed}; "
              f"router: {result['router'] or '-'}")


if __name__ == "__main__":
    main()
