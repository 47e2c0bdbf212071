"""kvstrata as `make serve` starts it beside llama-server as its users start it, on the same shipped GGUF.

    .venv/bin/python benchmarks/llama_server_served.py                 # ~35 min on 2 cores
    .venv/bin/python benchmarks/llama_server_served.py --only stream   # one stream, ~5 min
    .venv/bin/python benchmarks/llama_server_served.py --quick         # checks the pipeline
    .venv/bin/python benchmarks/llama_server_served.py --only stream --cap avx512_vnni   # as on an Ice Lake

--cap runs both under one ISA cap: kvstrata with kvstrata.core.machine.isa_cap_environ (its kernels, oneDNN,
FBGEMM and ATen stop at that level), llama-server built with the flags above that level off
(ISA_CAP=<cap> peers/install_llama_server.sh, a build of its own).

kvstrata serves the embedded SmolLM2 Q4_1 file with `make serve`'s flags (`--host-cache-memory 1GiB
--store disk`, every other setting at its default: the file at its own bits), on a fresh disk store;
llama-server serves the same file with `-np 16 -kvu`, its prompt caches at their defaults
(peers/serve_llama_server.sh). Both run side by side and `kvstrata bench serve` alternates them on the
same token-id requests:
- stream: one request at a time (random, 128 tokens in and out), the way most people use a model on a CPU;
- shared-prefix: sessions over 8 shared prefixes at three paced rates and all at once;
- multi-turn: conversations at three paced rates and all at once.
Ratios are kvstrata over llama-server (below 1, kvstrata's latency is lower; above 1, its throughput is
higher). Also prints where a served token went on kvstrata (its timelines: the model step, the engine
loop between steps, the HTTP side) for the one stream. Writes served.json and served.md into `--out`.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import servers

from kvstrata.core.machine import ISA_CAPS, isa_cap_environ

logger = logging.getLogger("llama_server_served")
KVSTRATA_FLAGS = ("--host-cache-memory", "1GiB", "--store", "disk")       # the Makefile's SERVE_ARGS
SLO = "ttft=2000,tpot=250"
P99 = ("ttft_ms.p99", "tpot_ms.p99", "itl_ms.p99", "e2el_ms.p99")


def cases(quick: bool) -> dict[str, list[str]]:
    """The `kvstrata bench serve` arguments of each case."""
    n = "8" if quick else "64"
    return {
        "stream": ["--workload", "random", "--num-requests", "2" if quick else "8", "--max-concurrency", "1",
                   "--input-len", "128", "--output-len", "16" if quick else "128", "--repeats", "1" if quick else "3"],
        "shared-prefix": ["--workload", "shared-prefix", "--num-requests", n, "--num-prefixes", "8",
                          "--request-rate", "1,3,5,inf", "--slo", SLO],
        "multi-turn": ["--workload", "multi-turn", "--num-requests", n, "--request-rate", "0.25,0.5,0.9,inf",
                       "--slo", SLO],
    }


def bench(out: Path, name: str, flags: list[str], urls: tuple[str, str], patience: float) -> dict:
    stem = out / name
    command = [str(servers.BIN / "kvstrata"), "bench", "serve", "--base-url", urls[0], "--compare-url", urls[1],
               "--label", "kvstrata", "--label", "llama-server", "--no-progress", "--warmup-requests", "2",
               "--patience", str(patience), "--output", str(stem), *flags]
    logger.info("%s: %s", name, " ".join(command))
    with open(f"{stem}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    return json.loads(Path(f"{stem}.json").read_text())


def token_breakdown(result: dict) -> dict[str, float]:
    """kvstrata's summed timeline breakdown of every request, in ms per output token."""
    summed = result["tails"]["kvstrata"]["all"]["breakdown"]
    tokens = sum(r["output_tokens"] for run in result["runs"] if run["label"] == "kvstrata" for r in run["requests"]
                 if r["ok"])
    assert summed and tokens, "kvstrata returned no timelines"
    return {part: seconds * 1e3 / tokens for part, seconds in summed.items()}


def markdown(results: dict[str, dict]) -> str:
    lines = []
    if "stream" in results:
        stream = results["stream"]
        ratio = stream["ratios"]["kvstrata/llama-server"]
        k, ls = stream["summary"]["kvstrata"], stream["summary"]["llama-server"]
        lines += ["One stream (ratio kvstrata / llama-server):", "", "| figure | kvstrata | llama-server | ratio |",
                  "|---|---:|---:|---:|"]
        for key, name in (("output_throughput", "output tok/s"), ("ttft_ms.p50", "TTFT p50 (ms)"),
                          ("tpot_ms.p50", "TPOT p50 (ms)"), ("tpot_ms.p99", "TPOT p99 (ms)"),
                          ("itl_ms.p50", "ITL p50 (ms)"), ("e2el_ms.p50", "E2E p50 (ms)")):
            group, _, stat = key.partition(".")
            mine, theirs = (k[group][stat], ls[group][stat]) if stat else (k[key], ls[key])
            lines.append(f"| {name} | {mine:.2f} | {theirs:.2f} | {ratio[key]:.3f}x |")
        parts = token_breakdown(stream)
        lines += ["", "kvstrata's served token, ms per output token by its timelines: "
                  + ", ".join(f"{part} {ms:.3f}" for part, ms in parts.items() if ms >= 0.0005), ""]
    for name in ("shared-prefix", "multi-turn"):
        if name not in results:
            continue
        lines += [f"{name} (rows: rate /s; kvstrata / llama-server):", "",
                  "| rate | output tok/s | TTFT p99 | TPOT p99 | ITL p99 | E2E p99 | cached prompt share |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for point in results[name]["sweep"]:
            ratio = point["ratios"]["kvstrata/llama-server"]
            shares = "/".join(f"{cached_share(point, label):.0%}" for label in ("kvstrata", "llama-server"))
            rate = point["request_rate"]
            lines.append(f"| {'all at once' if rate == 'inf' else rate} | {ratio['output_throughput']:.2f}x | "
                         + " | ".join(f"{ratio[key]:.2f}x" for key in P99) + f" | {shares} |")
        lines.append("")
    return "\n".join(lines)


def cached_share(point: dict, label: str) -> float:
    requests = [r for run in point["runs"] if run["label"] == label for r in run["requests"] if r["ok"]]
    prompt = sum(r["prompt_tokens"] or 0 for r in requests)
    return sum(r["cached_tokens"] or 0 for r in requests) / prompt if prompt else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=("stream", "shared-prefix", "multi-turn"), default=None)
    parser.add_argument("--quick", action="store_true", help="a few short requests per case")
    parser.add_argument("--patience", type=float, default=120)
    parser.add_argument("--cap", choices=ISA_CAPS, default=None, help="run both engines under this ISA cap")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / time.strftime("served-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    peer_cap = {"ISA_CAP": args.cap} if args.cap else {}
    servers.install_peers(args.out, ("llama_server",), peer_cap)
    chosen = {name: flags for name, flags in cases(args.quick).items() if args.only is None or name in args.only}
    with tempfile.TemporaryDirectory(prefix="kvstrata-store-") as store:
        pair = (servers.kvstrata("kvstrata", 8101, *KVSTRATA_FLAGS, "--store-path", store),
                servers.llama_server("llama-server", 8102))
        pair[0].env.update(isa_cap_environ(args.cap) if args.cap else {})
        pair[1].env.update(peer_cap)
        results: dict[str, dict] = {}
        try:
            for server in pair:
                server.start(args.out / f"{server.label}.log")
            for server in pair:
                logger.info("%s ready after %.1f s", server.label, server.wait_ready())
            for name, flags in chosen.items():
                results[name] = bench(args.out, name, flags, (pair[0].url, pair[1].url), args.patience)
        finally:
            for server in pair:
                server.stop()
    (args.out / "served.json").write_text(json.dumps({name: {k: v for k, v in result.items() if k != "runs"}
                                                      for name, result in results.items()}, indent=1))
    table = markdown(results)
    (args.out / "served.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
