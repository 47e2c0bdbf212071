"""Speculation served against speculation offline, on the same requests: does a served reply keep the
speed-up the engine gets in-process?

    .venv/bin/python benchmarks/speculative_served.py             # ~10 minutes on the 2-core machine
    .venv/bin/python benchmarks/speculative_served.py --quick     # checks the pipeline

Two workloads of kvstrata/bench/grounded.py, one request at a time, greedy, exactly --output-len tokens
(EOS ignored), kvstrata at its defaults otherwise (`make serve`'s model and bits):
    quote-summary   n-gram prompt lookup (`--speculative-config`, --ngram) against none
    code-edit       the request's OpenAI prediction (the original file) against the same request without it

Offline: `kvstrata bench offline --num-prompts 1` on each workload, with and without the drafts (a
prediction needs no flag: code-edit-predicted against code-edit, the same prompts). Served: three fresh
servers with `make serve`'s flags (`off`; `ngram`, with --speculative-config; `prediction`, which gets
the code-edit requests with their prediction as OpenAI's `prediction` field), the very prompts of the
offline repeats as chat requests, each request to the servers in turn, each whole reply timed from
sending to its last byte (no server sees a prompt twice: nothing comes from a prefix cache). A speed-up is the time without drafts over
the time with them, summed over the repeats. Prints each served speed-up over its offline one (the
issue asks for at least 0.85: within 15%) and writes speculative_served.json into --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

import servers

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PORTS = {"off": 18831, "ngram": 18832, "prediction": 18833}
MODEL = "SmolLM2-135M-Instruct"


def offline(out: Path, workload: str, spec: bool, args: argparse.Namespace) -> float:
    """Seconds of the --repeats prompts one at a time through `kvstrata bench offline`, all repeats summed
    (its tok/s figure is the fastest repeat's: with drafts, the prompt that quotes most)."""
    stem = out / f"offline-{workload}-{'on' if spec else 'off'}"
    command = [str(servers.BIN / "kvstrata"), "bench", "offline", "--workload", workload, "--num-prompts", "1",
               "--output-len", str(args.output_len), "--repeats", str(args.repeats), "--json", f"{stem}.json"]
    if spec:
        command += ["--speculative-config", json.dumps(NGRAM)]
    with open(f"{stem}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    [case] = json.loads(Path(f"{stem}.json").read_text())["cases"]
    assert len(case["elapsed_s"]) == args.repeats
    return sum(case["elapsed_s"])


def served(requests: list[tuple[str, tuple[str, str]]], args: argparse.Namespace) -> dict[str, float]:
    """Seconds of whole replies: each quote-summary without and with n-gram drafts, each code-edit without
    and with its prediction, taking turns."""
    spent = {"quote off": 0.0, "quote ngram": 0.0, "edit off": 0.0, "edit prediction": 0.0}
    with httpx.Client(timeout=600) as client:
        def reply(port: int, message: str, prediction: str | None) -> float:
            body = {"model": MODEL, "messages": [{"role": "user", "content": message}], "temperature": 0,
                    "max_tokens": args.output_len, "ignore_eos": True}
            if prediction:
                body["prediction"] = {"type": "content", "content": prediction}
            start = time.perf_counter()
            answer = client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
            answer.raise_for_status()
            assert answer.json()["usage"]["completion_tokens"] == args.output_len, answer.text
            return time.perf_counter() - start
        for quote, edit in requests:
            spent["quote off"] += reply(PORTS["off"], quote, None)
            spent["quote ngram"] += reply(PORTS["ngram"], quote, None)
            spent["edit off"] += reply(PORTS["off"], edit[0], None)
            spent["edit prediction"] += reply(PORTS["prediction"], edit[0], edit[1])
    return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="32 tokens, one repeat")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / time.strftime("spec-served-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    from kvstrata.bench.grounded import grounded_prompts
    from kvstrata.core.machine import machine

    if args.quick:
        args.output_len, args.repeats = 32, 1
    args.out.mkdir(parents=True, exist_ok=True)
    speedups = {}
    for workload, drafted in (("quote-summary", "quote-summary"), ("code-edit", "code-edit-predicted")):
        plain = offline(args.out, workload, False, args)
        with_drafts = offline(args.out, drafted, drafted == workload, args)
        speedups[f"{workload} offline"] = plain / with_drafts
        print(f"offline {workload}: {plain:.2f} s without drafts, {with_drafts:.2f} s with "
              f"({speedups[f'{workload} offline']:.2f}x)", flush=True)
    # the prompts of bench offline's repeats: the first --repeats variants of each workload, in order
    quotes, edits = grounded_prompts("quote-summary"), grounded_prompts("code-edit-predicted")
    requests = [(quotes[i % len(quotes)].message, (edits[i % len(edits)].message, edits[i % len(edits)].prediction))
                for i in range(args.repeats)]
    warm_up = [(quotes[-1].message, (edits[-1].message, edits[-1].prediction))]   # never one of the timed ones
    fleet = [servers.kvstrata(name, port, "--host-cache-memory", "1GiB", "--store", "disk", "--store-path",
                              str(args.out / f"store-{name}"),
                              *(["--speculative-config", json.dumps(NGRAM)] if name == "ngram" else []))
             for name, port in PORTS.items()]
    try:
        for server in fleet:
            server.start(args.out / f"server-{server.label}.log")
        for server in fleet:
            server.wait_ready()
        served(warm_up, argparse.Namespace(output_len=16))
        spent = served(requests, args)
    finally:
        for server in fleet:
            server.stop()
    speedups["quote-summary served"] = spent["quote off"] / spent["quote ngram"]
    speedups["code-edit served"] = spent["edit off"] / spent["edit prediction"]
    report = {"machine": machine().describe(), "output_len": args.output_len, "repeats": args.repeats,
              "ngram": NGRAM, "served_seconds": spent, "speedups": speedups,
              "served_over_offline": {w: speedups[f"{w} served"] / speedups[f"{w} offline"]
                                      for w in ("quote-summary", "code-edit")}}
    (args.out / "speculative_served.json").write_text(json.dumps(report, indent=1) + "\n")
    for workload in ("quote-summary", "code-edit"):
        print(f"{workload}: offline {speedups[f'{workload} offline']:.2f}x, served {speedups[f'{workload} served']:.2f}x "
              f"(served / offline {report['served_over_offline'][workload]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
