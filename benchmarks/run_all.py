"""`make bench`: install the peers, measure everything in one run, regenerate BENCHMARKS.md.

    .venv/bin/python benchmarks/run_all.py              # about 50 minutes on the 2-core machine
    .venv/bin/python benchmarks/run_all.py --quick      # tiny sizes: checks the pipeline in a few minutes
    .venv/bin/python benchmarks/run_all.py --render benchmarks/results/20261129-220000   # tables from saved results

Offline: the same token ids (single stream and batch 32, 128 in / 128 out) through kvstrata's
Python API (each torch dtype, and `--quantization int8`), transformers `generate`, llama.cpp and
vLLM, each in its own process and venv; then 256 prompts through kvstrata and vLLM in the served dtype,
and 16 sequences decoding over one shared cached prefix against 16 with distinct contexts
(benchmarks/shared_prefix_decode.py, each torch dtype). One fixed model step is timed at the start and
at the end of the run (`probe`), so the tables say how much the host's speed moved under them.
Served: kvstrata with prefix caching on, kvstrata with it off, and vLLM serve side by side; for
each workload (shared-prefix, multi-turn, shared-prefix with at most 16 requests in flight, and
both again with every arrival at once, to measure throughput)
`kvstrata bench serve` alternates them on the same request sequence. Then the offline cases and the
shared-prefix workload again at llama-3.2-1b's shape with dummy weights, beside vLLM, llama.cpp and
llama-server (benchmarks/real_shapes.py). Peers are
never kvstrata dependencies: they live in benchmarks/peers/venvs (git-ignored).
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

from servers import BIN, PEERS, ROOT, THREADS, Server, peer_env

VENVS = PEERS / "venvs"
MODEL_NAME = "SmolLM2-135M-Instruct"

logger = logging.getLogger("run_all")


@dataclass(frozen=True)
class Sizes:
    offline_batches: tuple[int, ...] = (1, 32)
    offline_len: int = 128
    offline_repeats: int = 3
    many_prompts: int = 256            # one more offline case, kvstrata and vLLM only (64 sequences at a time)
    many_repeats: int = 2
    prefix_decode: tuple[str, ...] = ()   # benchmarks/shared_prefix_decode.py's arguments beyond dtype (its defaults)
    probe_repeat: int = 20                # steps the host probe times per shape (fastest and median)
    serve_repeats: int = 2
    shared_prefix: tuple[str, ...] = ("--num-requests", "64", "--num-prefixes", "4", "--prefix-len", "512",
                                      "--input-len", "64", "--output-len", "64", "--request-rate", "1")
    multi_turn: tuple[str, ...] = ("--num-requests", "64", "--turns", "4", "--input-len", "128",
                                   "--output-len", "64", "--turn-gap", "1", "--request-rate", "0.5")
    sustained: tuple[str, ...] = ("--max-concurrency", "16")   # shared-prefix again, at most 16 in flight
    saturated: tuple[str, ...] = ("--request-rate", "inf")     # every request (conversation) at once
    back_to_back: tuple[str, ...] = ("--turn-gap", "0")        # multi-turn: each turn as soon as the last reply ends
    slo: str = "ttft=2000,tpot=250"

    def served(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """(results name, workload, its arguments) of each served run. At the first two's arrival rates
        both servers keep up, so their throughput is the offered load and their latencies are the
        figures; the capped run measures the engines with at most 16 requests in flight; the saturated
        runs (all arrivals at once, later arguments win) measure throughput, which the others cannot."""
        return [("shared-prefix", "shared-prefix", self.shared_prefix), ("multi-turn", "multi-turn", self.multi_turn),
                ("shared-prefix-c16", "shared-prefix", self.shared_prefix + self.sustained),
                ("shared-prefix-saturated", "shared-prefix", self.shared_prefix + self.saturated),
                ("multi-turn-saturated", "multi-turn", self.multi_turn + self.saturated + self.back_to_back)]


QUICK = Sizes(offline_batches=(1, 4), offline_len=16, offline_repeats=1, many_prompts=8, many_repeats=1,
              serve_repeats=1,
              shared_prefix=("--num-requests", "8", "--num-prefixes", "2", "--prefix-len", "64",
                             "--input-len", "16", "--output-len", "8", "--request-rate", "4"),
              multi_turn=("--num-requests", "8", "--turns", "2", "--input-len", "16", "--output-len", "8",
                          "--turn-gap", "0.2", "--request-rate", "2"),
              sustained=("--max-concurrency", "2"),
              prefix_decode=("--seqs", "4", "--prefix", "64", "--tokens", "8", "--repeat", "1"), probe_repeat=3)


def run(command: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 1800) -> None:
    """Run to completion, output to `log` (and its tail to the console on failure)."""
    logger.info("$ %s", " ".join(command))
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout,
                              env={**os.environ, **(env or {})})
    if done.returncode:
        raise RuntimeError(f"{command[0]} failed ({done.returncode}); see {log}:\n{log.read_text()[-3000:]}")


def machine_facts() -> dict:
    """`kvstrata.core.machine` (CPU, cores, ISA, torch) plus the kernel the tables explain figures with."""
    from kvstrata.core.machine import machine

    return {**machine().as_dict(), "kernel": os.uname().release}


def probe(out: Path, when: str, sizes: Sizes, dtype: str) -> None:
    """Time one fixed model step (decode of 1 and 32 sequences at 600 tokens) at the start and the
    end of the run: the same code on the same machine, so a difference between the two is the host
    changing speed under the run (it has, by 10-60% within an hour here), and BENCHMARKS.md says so."""
    run([sys.executable, str(ROOT / "benchmarks" / "model_step.py"), "--dtypes", dtype, "--batches", "1", "32",
         "--ctx", "600", "--prefills", "--threads", str(THREADS), "--repeat", str(sizes.probe_repeat),
         "--json", str(out / f"probe-{when}.json")], out / f"probe-{when}.log")


# ---- offline ------------------------------------------------------------------------------------
def torch_dtypes() -> list[str]:
    """fp32 always; bf16 too where the CPU has native bf16 (without it bf16 GEMMs run 3-8x slower)."""
    from kvstrata.model.formats.dense import native_bf16

    return ["float32"] + (["bfloat16"] if native_bf16() else [])


def offline(out: Path, sizes: Sizes, hf_folder: str, gguf: str, patience: float) -> None:
    from kvstrata.bench.cases import write_cases
    from kvstrata.bench.offline import make_cases

    prompts = out / "offline-prompts.json"
    write_cases(prompts, make_cases(list(sizes.offline_batches), sizes.offline_len, sizes.offline_len,
                                    sizes.offline_repeats, seed=0))
    many = out / "offline-prompts-many.json"
    write_cases(many, make_cases([sizes.many_prompts], sizes.offline_len, sizes.offline_len, sizes.many_repeats, seed=1))

    def common(cases: Path) -> list[str]:
        return ["--prompts", str(cases), "--threads", str(THREADS), "--patience", str(patience)]

    def kvstrata(cases: Path, *flags: str) -> list[str]:
        return [str(BIN / "kvstrata"), "bench", "offline", *common(cases), *flags]

    def peer(venv: str, script: str, cases: Path, model: str, *flags: str) -> list[str]:
        return [str(VENVS / venv / "bin/python"), str(PEERS / script), *common(cases), "--model", model, *flags]

    jobs = []
    for dtype in torch_dtypes():
        jobs += [(f"kvstrata-{dtype}", kvstrata(prompts, "--dtype", dtype)),
                 (f"hf-{dtype}", peer("hf", "offline_hf.py", prompts, hf_folder, "--dtype", dtype)),
                 (f"vllm-{dtype}", peer("vllm", "offline_vllm.py", prompts, hf_folder, "--dtype", dtype))]
    jobs.append(("kvstrata-int8", kvstrata(prompts, "--quantization", "int8")))
    jobs.append(("kvstrata-int8-compile", kvstrata(prompts, "--quantization", "int8", "--compile")))
    q8_0 = out / "smollm2-q8_0.gguf"          # llama.cpp's 8-bit peer of our int8, made from what we ship
    run([sys.executable, str(PEERS / "make_q8_0.py"), str(q8_0), "--model", gguf], out / "make-q8_0.log")
    for quant, path in (("q4_1", gguf), ("q8_0", str(q8_0))):
        jobs.append((f"llamacpp-{quant}", peer("llamacpp", "offline_llamacpp.py", prompts, path)))
    dtype = torch_dtypes()[-1]                # the served dtype
    jobs += [(f"many-kvstrata-{dtype}", kvstrata(many, "--dtype", dtype)),
             (f"many-vllm-{dtype}", peer("vllm", "offline_vllm.py", many, hf_folder, "--dtype", dtype))]
    for name, command in jobs:
        run([*command, "--json", str(out / f"offline-{name}.json")], out / f"offline-{name}.log", env=peer_env())
    for dtype in torch_dtypes():              # decoding over one shared cached prefix vs distinct contexts
        run([sys.executable, str(ROOT / "benchmarks" / "shared_prefix_decode.py"), *sizes.prefix_decode, "--dtype", dtype,
             "--threads", str(THREADS), "--patience", str(patience), "--json", str(out / f"prefix-decode-{dtype}.json")],
            out / f"prefix-decode-{dtype}.log")


# ---- served -------------------------------------------------------------------------------------
KVSTRATA_SERVE = ("--max-num-seqs", "64", "--kv-cache-memory", "2GiB", "--threads", str(THREADS))
VLLM_SERVE = ("--max-num-seqs", "64", "--enable-prompt-tokens-details")   # the latter: cached_tokens in usage


def servers(dtype: str) -> list[Server]:
    kvstrata = [str(BIN / "kvstrata"), "serve", *KVSTRATA_SERVE, "--dtype", dtype]
    return [Server("kvstrata", 18601, [*kvstrata, "--port", "18601"]),
            Server("vllm", 18603, [str(PEERS / "serve_vllm.sh"), "18603", *VLLM_SERVE, "--dtype", dtype]),
            Server("kvstrata-nocache", 18602, [*kvstrata, "--port", "18602", "--no-enable-prefix-caching"])]


def served(out: Path, sizes: Sizes, dtype: str, patience: float) -> dict[str, float]:
    """Start the servers, run each workload against all of them alternating; start-up seconds per server."""
    started = {}
    with contextlib.ExitStack() as stack:
        group = servers(dtype)
        for server in group:
            stack.callback(server.stop)
            server.start(out / f"server-{server.label}.log")
        for server in group:
            started[server.label] = server.wait_ready()
        urls = ["--base-url", group[0].url] + [a for s in group[1:] for a in ("--compare-url", s.url)]
        labels = [a for s in group for a in ("--label", s.label)]
        for name, workload, args in sizes.served():
            run([str(BIN / "kvstrata"), "bench", "serve", *urls, *labels, "--workload", workload, *args,
                 "--repeats", str(sizes.serve_repeats), "--seed", "0", "--slo", sizes.slo, "--no-progress",
                 "--patience", str(patience),
                 "--output", str(out / f"serve-{name}")], out / f"serve-{name}.log", timeout=3600)
    return started


# ---- everything ---------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the pipeline")
    parser.add_argument("--only", choices=("offline", "serve", "shapes"), default=None)
    parser.add_argument("--render", metavar="RESULTS", default=None, help="only rewrite BENCHMARKS.md from RESULTS")
    parser.add_argument("--patience", type=float, default=180,
                        help="seconds each timed repeat may wait for other jobs to leave the cores (default: 180)")
    parser.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from render_md import render

    if args.render:
        Path(args.output).write_text(render(Path(args.render), Path(args.output)))
        return 0
    out = ROOT / "benchmarks" / "results" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    for peer in ("hf", "llamacpp", "vllm"):
        run([str(PEERS / f"install_{peer}.sh")], out / f"install-{peer}.log", timeout=3600)
    from kvstrata.entrypoints.cli.bench import default_model_folder
    from kvstrata.model.loader import default_model_path

    serve_dtype = torch_dtypes()[-1]
    facts = {"machine": machine_facts(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
             "load_before": os.getloadavg(), "quick": args.quick, "threads": THREADS, "serve_dtype": serve_dtype,
             "kvstrata_serve": [*KVSTRATA_SERVE, "--dtype", serve_dtype],
             "vllm_serve": [*VLLM_SERVE, "--dtype", serve_dtype]}
    sizes = QUICK if args.quick else Sizes()
    begin = time.monotonic()
    probe(out, "start", sizes, serve_dtype)
    if args.only in (None, "offline"):
        offline(out, sizes, str(default_model_folder()), str(default_model_path()), args.patience)
    if args.only in (None, "serve"):
        facts["server_start_s"] = served(out, sizes, serve_dtype, args.patience)
    if args.only in (None, "shapes"):         # the same cases at llama-3.2-1b's shape, llama-server beside
        run([sys.executable, str(ROOT / "benchmarks" / "real_shapes.py"), "--out", str(out), "--patience",
             str(args.patience), *(["--quick"] if args.quick else [])], out / "shapes.log", timeout=3 * 3600)
    probe(out, "end", sizes, serve_dtype)
    facts.update(load_after=os.getloadavg(), minutes=round((time.monotonic() - begin) / 60, 1),
                 versions=peer_versions())
    (out / "run.json").write_text(json.dumps(facts, indent=1))
    Path(args.output).write_text(render(out, Path(args.output)))
    logger.info("results in %s; wrote %s", out, args.output)
    return 0


def peer_versions() -> dict[str, str]:
    def version(venv: str, module: str) -> str:
        done = subprocess.run([str(VENVS / venv / "bin/python"), "-c", f"import {module}; print({module}.__version__)"],
                              capture_output=True, text=True)
        return done.stdout.strip() or "?"
    import torch

    return {"kvstrata torch": torch.__version__, "transformers (hf venv)": version("hf", "transformers"),
            "torch (hf venv)": version("hf", "torch"), "llama-cpp-python": version("llamacpp", "llama_cpp"),
            "vllm": version("vllm", "vllm"), "torch (vllm venv)": version("vllm", "torch")}


if __name__ == "__main__":
    sys.exit(main())
