"""kvstrata beside vLLM and llama.cpp at a real model shape (dummy weights): offline and served, one run.

    .venv/bin/python benchmarks/real_shapes.py                        # llama-3.2-1b, ~40 min on 2 cores
    .venv/bin/python benchmarks/real_shapes.py --quick                # tiny sizes: checks the pipeline
    .venv/bin/python benchmarks/real_shapes.py --only offline --out benchmarks/results/shapes-x

Every figure before this came from SmolLM2-135M; at 1B-8B a token of prompt costs 9-60x the FLOPs and
a decode step reads 9-60x the bytes. Speed does not depend on weight values, so each engine runs the
shape with random weights: kvstrata `--load-format dummy`, vLLM its own `--load-format dummy`, llama.cpp
a GGUF of kvstrata's dummy weights (peers/dummy_gguf.py) in BF16, Q8_0 and Q4_0.
- offline: batch 1 and batch 32, 128 prompt and 128 output tokens, the same token ids for every engine
  (`kvstrata bench offline`, peers/offline_vllm.py, peers/offline_llamacpp.py: llama.cpp's library);
- served: the shared-prefix workload through `kvstrata bench serve`, kvstrata, vLLM and llama-server
  (`-np 16 -kvu` as its users start it; on `--served-gguf`) running side by side, alternated on the same
  request sequence.
Ratios are kvstrata over each engine (above 1, kvstrata is faster). They set the targets of the issue
that makes one stream as fast as llama.cpp; this script only measures. Writes shapes.json and shapes.md
into `--out`; `make bench` runs it (benchmarks/run_all.py) and puts shapes.md into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import servers

logger = logging.getLogger("shapes")
VENVS = servers.PEERS / "venvs"
GGUF_TYPES = ("bf16", "q8_0", "q4_0")


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...] = (1, 32)
    length: int = 128
    repeats: int = 2
    serve: tuple[str, ...] = ("--num-requests", "32", "--num-prefixes", "4", "--prefix-len", "512", "--input-len",
                              "64", "--output-len", "64", "--request-rate", "0.25")
    serve_repeats: int = 1


QUICK = Sizes(batches=(1, 4), length=16, repeats=1,
              serve=("--num-requests", "4", "--num-prefixes", "2", "--prefix-len", "64", "--input-len", "16",
                     "--output-len", "8", "--request-rate", "1"))


def run(command: list[str], log: Path, timeout: float = 3600) -> None:
    logger.info("$ %s", " ".join(command))
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=servers.ROOT, timeout=timeout,
                              env={**os.environ, **servers.peer_env()})
    if done.returncode:
        raise RuntimeError(f"{command[0]} failed ({done.returncode}); see {log}:\n{log.read_text()[-3000:]}")


def offline(out: Path, shape: str, sizes: Sizes, patience: float) -> dict[str, dict]:
    from kvstrata.bench.cases import write_cases
    from kvstrata.bench.offline import make_cases

    prompts = out / "shapes-prompts.json"
    write_cases(prompts, make_cases(list(sizes.batches), sizes.length, sizes.length, sizes.repeats, seed=0))
    common = ["--prompts", str(prompts), "--threads", str(servers.THREADS), "--patience", str(patience)]
    peer = lambda venv, script: [str(VENVS / venv / "bin/python"), str(servers.PEERS / script), *common]  # noqa: E731
    jobs = {"kvstrata-bfloat16": [str(servers.BIN / "kvstrata"), "bench", "offline", *common, "--load-format", "dummy",
                                  "--model", shape, "--dtype", "bfloat16"],
            "vllm-bfloat16": [*peer("vllm", "offline_vllm.py"), "--load-format", "dummy", "--model", shape,
                              "--dtype", "bfloat16"]}
    for kind in GGUF_TYPES:
        jobs[f"llamacpp-{kind}"] = [*peer("llamacpp", "offline_llamacpp.py"), "--model",
                                    str(servers.dummy_gguf(shape, kind))]
    figures = {}
    for name, command in jobs.items():
        run([*command, "--json", str(out / f"shapes-offline-{name}.json")], out / f"shapes-offline-{name}.log")
        figures[name] = json.loads((out / f"shapes-offline-{name}.json").read_text())
    return figures


def served(out: Path, shape: str, sizes: Sizes, gguf_type: str, patience: float) -> dict:
    group = [servers.kvstrata("kvstrata", 18671, "--max-num-seqs", "64", "--kv-cache-memory", "2GiB", "--dtype",
                              "bfloat16", shape=shape),
             servers.vllm("vllm", 18672, "--max-num-seqs", "64", "--dtype", "bfloat16", shape=shape,
                          kv_bytes=2 * 1024**3),
             servers.llama_server(f"llama-server-{gguf_type}", 18673, shape=shape, gguf_type=gguf_type)]
    with contextlib.ExitStack() as stack:
        for server in group:
            stack.callback(server.stop)
            server.start(out / f"shapes-server-{server.label}.log")
        started = {server.label: server.wait_ready() for server in group}
        urls = ["--base-url", group[0].url] + [a for s in group[1:] for a in ("--compare-url", s.url)]
        labels = [a for s in group for a in ("--label", s.label)]
        run([str(servers.BIN / "kvstrata"), "bench", "serve", *urls, *labels, "--workload", "shared-prefix",
             *sizes.serve, "--repeats", str(sizes.serve_repeats), "--seed", "0", "--no-progress", "--patience",
             str(patience), "--output", str(out / "shapes-serve")], out / "shapes-serve.log")
    return {"started_s": started, "log": (out / "shapes-serve.log").read_text()[-6000:]}


def markdown(report: dict) -> str:
    """The offline table with ratios, and the served run's own printed table."""
    lines = [f"## {report['shape']} (dummy weights) beside vLLM and llama.cpp, {report['date']}", "",
             f"Machine: {report['machine']}. {report['threads']} threads each; {report['length']} prompt and "
             f"{report['length']} output tokens; fastest of {report['repeats']} repeats (median in brackets). "
             "Ratios: kvstrata bf16 over the engine (above 1, kvstrata is faster).", ""]
    offline = report.get("offline") or {}
    if offline:
        base = {c["name"]: c for c in offline["kvstrata-bfloat16"]["cases"]}
        names = list(base)
        lines += ["| engine | weights | " + " | ".join(f"{n} tok/s" for n in names) + " | "
                  + " | ".join(f"kvstrata ÷, {n}" for n in names) + " |", "|---|---|" + "---:|" * 2 * len(names)]
        for key, data in offline.items():
            cases = {c["name"]: c for c in data["cases"]}
            lines.append(f"| {data['engine']} {data.get('version', '')} | {key.split('-', 1)[1]} | "
                         + " | ".join(f"{cases[n]['output_tok_s']:.1f} ({cases[n]['median_output_tok_s']:.1f})"
                                      for n in names) + " | "
                         + " | ".join("—" if key == "kvstrata-bfloat16" else
                                      f"{base[n]['output_tok_s'] / cases[n]['output_tok_s']:.2f}" for n in names) + " |")
    if report.get("served"):
        lines += ["", "Served, shared-prefix (`kvstrata bench serve`'s own table; ratios base/other):", "", "```",
                  report["served"]["log"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the pipeline")
    parser.add_argument("--only", choices=("offline", "serve"), default=None)
    parser.add_argument("--served-gguf", default="q8_0", choices=GGUF_TYPES, help="llama-server's weights")
    parser.add_argument("--patience", type=float, default=180)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / time.strftime("shapes-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from kvstrata.core.machine import machine

    sizes = QUICK if args.quick else Sizes()
    args.out.mkdir(parents=True, exist_ok=True)
    servers.install_peers(args.out, ("vllm", "llamacpp", "llama_server"))
    report = {"shape": args.shape, "machine": machine().describe(), "date": time.strftime("%Y-%m-%d"),
              "threads": servers.THREADS, "length": sizes.length, "repeats": sizes.repeats, "quick": args.quick}
    if args.only in (None, "offline"):
        report["offline"] = offline(args.out, args.shape, sizes, args.patience)
    if args.only in (None, "serve"):
        report["served"] = served(args.out, args.shape, sizes, args.served_gguf, args.patience)
    (args.out / "shapes.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "shapes.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
