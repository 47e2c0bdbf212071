"""`kvstrata router` over two real engines vs what `kvstrata simulate` predicts, per routing policy.

Writes a multi-turn Mooncake trace (conversations whose every turn adds a 512-token block to the
last turn's prompt; the reply is not part of the next prompt), then for each policy:

    real       two fresh `kvstrata serve` engines (--dtype auto and 1 thread each, as `kvstrata calibrate`
               made the shipped profile; bf16 on a CPU with AVX-512 BF16)
               behind `kvstrata router --policy P`, driven by `kvstrata bench serve --workload trace:`
    simulated  `kvstrata simulate --instances 2 --router P` on the same trace with the calibrated
               profile and the engines' device KV (1,456 blocks of 16 = 23,296 tokens, set on both sides)

and prints TTFT p50/p99 and the cached prompt fraction of both, with the relative error of the
simulation. Timings on a shared machine mostly measure the neighbours: state the load (printed).

Run: .venv/bin/python benchmarks/router_fleet.py [--conversations 8] [--turns 3] [--time-scale 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from kvstrata.bench.fleets import kvstrata, wait_ready

PROFILE = Path(__file__).parent / "profiles" / "cpu-2core-smollm2.json"
DEVICE_TOKENS = 23296
TRACE_BLOCK = 512


def write_trace(path: Path, conversations: int, turns: int, seed: int = 7) -> None:
    """Conversation c starts at 3c s; its turns are 10 s apart; turn t's prompt spans t+1 blocks."""
    rng, lines, next_id = random.Random(seed), [], 1
    for c in range(conversations):
        ids: list[int] = []
        for t in range(turns):
            ids, next_id = ids + [next_id], next_id + 1
            lines.append({"timestamp": c * 3000 + t * 10000, "output_length": 16, "hash_ids": list(ids),
                          "input_length": (len(ids) - 1) * TRACE_BLOCK + rng.randint(300, 500)})
    lines.sort(key=lambda line: line["timestamp"])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def real_run(policy: str, trace: Path, requests: int, time_scale: float, out: Path, port: int) -> dict:
    engines = [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
    logs = open(out / f"fleet-{policy}.log", "w")
    processes = [kvstrata("serve", "--port", url.rsplit(":", 1)[1], "--threads", "1",
                          "--num-device-blocks", str(DEVICE_TOKENS // 16),
                          "--log-level", "WARNING", stdout=logs, stderr=subprocess.STDOUT) for url in engines]
    flags = [flag for url in engines for flag in ("--engine", url)]
    processes.append(kvstrata("router", "--port", str(port), "--policy", policy, "--log-level", "WARNING", *flags,
                              stdout=logs, stderr=subprocess.STDOUT))
    router = f"http://127.0.0.1:{port}"
    try:
        wait_ready(router, processes)
        load = os.getloadavg()[0]
        subprocess.run([sys.executable, "-m", "kvstrata", "bench", "serve", "--base-url", router,
                        "--workload", f"trace:{trace}", "--trace-time-scale", str(time_scale), "--output-len", "16",
                        "--num-requests", str(requests), "--output", str(out / f"real-{policy}"), "--no-progress",
                        "--timeout", "600"], check=True, stdout=subprocess.DEVNULL)
        (summary,) = json.loads((out / f"real-{policy}.json").read_text())["summary"].values()
        return {"summary": summary, "load": (load, os.getloadavg()[0])}
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=60)
        logs.close()


def simulated_run(policy: str, trace: Path, time_scale: float, out: Path) -> dict:
    path = out / f"sim-{policy}.json"
    subprocess.run([sys.executable, "-m", "kvstrata", "simulate", "--trace", str(trace), "--time-scale",
                    str(time_scale), "--instances", "2", "--router", policy, "--profile", str(PROFILE),
                    "--block-size", "16", "--host-cache-tokens", "0", "--store-cache-tokens", "0",
                    "--device-cache-tokens", str(DEVICE_TOKENS), "--max-num-batched-tokens", "512",
                    "--max-num-seqs", "64", "--output-json", str(path)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=2.0, help="arrival times multiplied by this")
    parser.add_argument("--policies", default="kv_aware,round_robin")
    parser.add_argument("--port", type=int, default=18200, help="router port; engines on the next two")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="router-fleet-"))
    trace = out / "multiturn.jsonl"
    write_trace(trace, args.conversations, args.turns)
    requests = args.conversations * args.turns
    print(f"{requests} requests ({args.conversations} conversations x {args.turns} turns), time scale "
          f"{args.time_scale}; files in {out}")
    print(f"{'policy':<12} {'':>5} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'cached':>7}   load (1-min, start/end)")
    for policy in args.policies.split(","):
        sim = simulated_run(policy, trace, args.time_scale, out)
        real = real_run(policy, trace, requests, args.time_scale, out, args.port)
        summary = real["summary"]
        measured = (summary["ttft_ms"]["p50"] / 1000, summary["ttft_ms"]["p99"] / 1000, summary["cached_fraction"])
        predicted = (sim["ttft_s"]["p50"], sim["ttft_s"]["p99"], sim["hit_rate"]["total"])
        print(f"{policy:<12} {'real':>5} {measured[0]:>11.2f} {measured[1]:>11.2f} {measured[2]:>7.3f}   "
              f"{real['load'][0]:.1f} / {real['load'][1]:.1f}")
        print(f"{'':<12} {'sim':>5} {predicted[0]:>11.2f} {predicted[1]:>11.2f} {predicted[2]:>7.3f}   "
              "relative error " + ", ".join(f"{(p - m) / m:+.0%}" if m else "n/a" for p, m in zip(predicted, measured)))


if __name__ == "__main__":
    main()
