"""Soak a real `kvstrata serve` under injected faults, then check it rests with nothing held.

Starts the server with `KVSTRATA_FAULTS` (failing copies, encodes, decodes and model steps), a
small device cache over host and disk tiers so blocks keep moving, and drives shared-prefix
streaming traffic on loopback for `--minutes`. Then it waits for the engine to go idle and prints
requests served and failed, the faults injected, and the blocks per tier and state at rest.
Exits 1 if any block is USED or IN_FLIGHT at rest, the audit ever failed, or the server stopped
answering.

    .venv/bin/python benchmarks/fault_soak.py --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["rivers of France", "castles of the Loire", "history of printing", "the moons of Jupiter",
          "bread baking", "sailing ships", "mountain weather", "old clocks"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(base: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        match = re.match(r"^(kvstrata_\S+) (\S+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


async def one_request(http: httpx.AsyncClient, rng: random.Random, outcomes: Counter) -> None:
    topic = rng.choice(TOPICS)
    prompt = f"A long note about {topic}. " * 12 + f"Question {rng.randrange(1000)}: what matters most?"
    body = dict(model=MODEL, prompt=prompt, max_tokens=rng.randrange(4, 24), temperature=0, stream=True)
    finish = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" not in event:
                        finish = event["choices"][0]["finish_reason"] or finish
    except httpx.HTTPError as exc:
        finish = f"transport: {type(exc).__name__}"
    outcomes[finish or "none"] += 1


async def drive(base: str, seconds: float, concurrency: int, seed: int) -> Counter:
    outcomes: Counter = Counter()
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    last_report = time.monotonic()

    async def worker() -> None:
        nonlocal last_report
        while time.monotonic() < deadline:
            await one_request(http, rng, outcomes)
            if time.monotonic() - last_report > 30:
                last_report = time.monotonic()
                left = max(0, deadline - last_report)
                print(f"  {sum(outcomes.values())} requests, {dict(outcomes)}; {left:.0f} s left", flush=True)

    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--faults", default="copy=7,encode=5,decode=5,execute=50",
                        help="KVSTRATA_FAULTS for the server (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    port, workdir = free_port(), Path(tempfile.mkdtemp(prefix="kvstrata-soak-"))
    base = f"http://127.0.0.1:{port}"
    flags = ["--port", str(port), "--kv-cache-memory", "8MiB", "--host-cache-memory", "4MiB", "--store", "disk",
             "--store-path", str(workdir / "store"), "--audit-every-step"]
    log = open(workdir / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "kvstrata", "serve", *flags], stdout=log,
                              stderr=subprocess.STDOUT, env={**os.environ, "KVSTRATA_FAULTS": args.faults})
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        print(f"soaking {base} for {args.minutes:g} min, faults {args.faults}, log {workdir / 'server.log'}")
        started = time.monotonic()
        outcomes = asyncio.run(drive(base, args.minutes * 60, args.concurrency, args.seed))
        elapsed = time.monotonic() - started
        for _ in range(600):
            metrics = scrape(base)
            if sum(metrics[f'kvstrata_requests{{state="{s}"}}'] for s in ("running", "loading", "waiting")) == 0:
                break
            time.sleep(0.1)
        healthy = httpx.get(f"{base}/health", timeout=10).status_code == 200
    finally:
        server.terminate()
        server.wait(timeout=120)
        log.close()

    blocks = {key: int(value) for key, value in metrics.items() if key.startswith("kvstrata_kv_blocks")}
    held = {key: n for key, n in blocks.items() if ('state="used"' in key or 'state="in_flight"' in key) and n}
    faults = {key: int(v) for key, v in metrics.items() if key.startswith("kvstrata_transfer_faults")}
    print(f"\n{sum(outcomes.values())} requests in {elapsed:.0f} s: {dict(outcomes)}")
    print(f"step failures: {int(metrics['kvstrata_step_failures_total'])}; transfer faults: {faults}")
    print(f"store errors: { {k: int(v) for k, v in metrics.items() if k.startswith('kvstrata_store_errors')} }")
    print(f"hit tokens: { {k: int(v) for k, v in metrics.items() if k.startswith('kvstrata_prompt_tokens')} }")
    print("blocks at rest:", blocks)
    print(f"audit failures: {int(metrics['kvstrata_audit_failures_total'])}; healthy after: {healthy}; "
          f"server exit code: {server.returncode}")
    ok = not held and metrics["kvstrata_audit_failures_total"] == 0 and healthy
    print("RESULT:", "ok, nothing held at rest" if ok else f"FAILED, held: {held}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
