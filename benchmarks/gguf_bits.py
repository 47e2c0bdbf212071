"""One stream and a batch, at a GGUF's own bits: kvstrata `--quantization gguf` beside llama.cpp on the same file.

    .venv/bin/python benchmarks/gguf_bits.py                                  # the shipped SmolLM2 Q4_1
    .venv/bin/python benchmarks/gguf_bits.py --shape llama-3.2-1b --types q8_0 q4_0   # dummy weights, as GGUF
    .venv/bin/python benchmarks/gguf_bits.py --files A.gguf B.gguf            # any GGUF files
    .venv/bin/python benchmarks/gguf_bits.py --vllm                           # and vLLM's CPU build, bf16
    .venv/bin/python benchmarks/gguf_bits.py --quick                          # checks the pipeline

For each file, the same token-id prompts (batch 1 and 32 by default, 128 in and 128 out, greedy) through
kvstrata serving the file's blocks at their bits (`--quantization gguf`, kvstrata.model.formats.gguf),
kvstrata widening them to bfloat16 (`--quantization none --dtype bfloat16`, what it did before), and
llama.cpp's library on the file (peers/offline_llamacpp.py). Every engine gets the same threads; the
engines run in turn for `--rounds` rounds of `--repeats` timed repeats each, and each figure is the
fastest (median beside it): this VM's memory bandwidth moves by tens of percent over minutes. Prints a
table with kvstrata's own-bits speed over llama.cpp's (above 1, kvstrata is faster), kvstrata's batch-1
weight reads against the memory bandwidth its run measured, and writes gguf_bits.json and gguf_bits.md
into `--out`. Dummy-weight files come from peers/dummy_gguf.py (its q4_0 keeps the output matrix in
Q6_K, as llama-quantize does, which kvstrata keeps at 8 bits; bf16 files run at their 16 bits).
--vllm (the shipped file only) adds vLLM's CPU build on the same model in bfloat16 (the HF folder kvstrata's
loader converts the GGUF into: vLLM serves no GGUF on a CPU) and kvstrata's default over it.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import servers
from real_shapes import VENVS, run

logger = logging.getLogger("gguf_bits")
def jobs(gguf: Path, prompts: Path, patience: float, hf_folder: str | None) -> dict[str, list[str]]:
    """Each engine's command; vLLM's where `hf_folder` is given (the same model in HF form)."""
    common = ["--prompts", str(prompts), "--threads", str(servers.THREADS), "--patience", str(patience)]
    kvstrata = [str(servers.BIN / "kvstrata"), "bench", "offline", *common, "--model", str(gguf)]
    chosen = {"kvstrata-gguf": [*kvstrata, "--quantization", "gguf"],
              "kvstrata-bf16": [*kvstrata, "--quantization", "none", "--dtype", "bfloat16"],
              "llamacpp": [str(VENVS / "llamacpp" / "bin/python"), str(servers.PEERS / "offline_llamacpp.py"),
                           *common, "--model", str(gguf)]}
    if hf_folder:
        chosen["vllm-bf16"] = [str(VENVS / "vllm" / "bin/python"), str(servers.PEERS / "offline_vllm.py"), *common,
                               "--model", hf_folder, "--dtype", "bfloat16"]
    return chosen


def measure(out: Path, label: str, gguf: Path, prompts: Path, patience: float, rounds: int,
            hf_folder: str | None = None) -> dict[str, dict]:
    """Every engine once per round, the rounds one after another: this VM's memory bandwidth moves by tens
    of percent over minutes, and alternating spreads that over all engines alike."""
    commands = jobs(gguf, prompts, patience, hf_folder)
    runs: dict[str, list[dict]] = {engine: [] for engine in commands}
    for index in range(rounds):
        for engine, command in commands.items():
            stem = out / f"{label}-{engine}-round{index}"
            run([*command, "--json", f"{stem}.json"], Path(f"{stem}.log"))
            figures = json.loads(Path(f"{stem}.json").read_text())
            figures["log_tail"] = Path(f"{stem}.log").read_text()[-2000:]
            runs[engine].append(figures)
    return {engine: fastest_rounds(figures) for engine, figures in runs.items()}


def fastest_rounds(rounds: list[dict]) -> dict:
    """One engine's rounds as one: each case from its fastest round (with that run's measured memory
    bandwidth, where the engine measures it), its median the median of every round's repeats' median."""
    cases = []
    for index, case in enumerate(rounds[0]["cases"]):
        tried = [(r["cases"][index], r) for r in rounds]
        best, run_of_best = max(tried, key=lambda pair: pair[0]["output_tok_s"])
        cases.append({**best, "median_output_tok_s": statistics.median(c["median_output_tok_s"] for c, _ in tried),
                      "memory_read_gb_s": run_of_best.get("memory_read_gb_s")})
    return {**rounds[-1], "cases": cases}


def markdown(report: dict) -> str:
    lines = [f"## GGUF weights at their own bits beside llama.cpp, {report['date']}", "",
             f"Machine: {report['machine']}. {report['threads']} threads each; {report['length']} prompt and "
             f"{report['length']} output tokens, greedy; the engines in turn for {report['rounds']} rounds of "
             f"{report['repeats']} repeats, fastest kept (median in brackets). "
             "kvstrata gguf: `--quantization gguf`; kvstrata bf16: the same file widened to bfloat16. "
             "Ratio: kvstrata gguf over llama.cpp (above 1, kvstrata is faster).", ""]
    for label, figures in report["files"].items():
        cases = [c["name"] for c in figures["llamacpp"]["cases"]]
        lines += [f"**{label}**", "", "| engine | " + " | ".join(f"{c} tok/s" for c in cases) + " |",
                  "|---|" + "---:|" * len(cases)]
        for engine in figures:
            by_name = {c["name"]: c for c in figures[engine]["cases"]}
            lines.append(f"| {engine} | " + " | ".join(
                f"{by_name[c]['output_tok_s']:.1f} ({by_name[c]['median_output_tok_s']:.1f})" for c in cases) + " |")
        own = {c["name"]: c["output_tok_s"] for c in figures["kvstrata-gguf"]["cases"]}
        peer = {c["name"]: c["output_tok_s"] for c in figures["llamacpp"]["cases"]}
        lines.append("| kvstrata gguf ÷ llama.cpp | " + " | ".join(f"{own[c] / peer[c]:.2f}x" for c in cases) + " |")
        if "vllm-bf16" in figures:
            vllm = {c["name"]: c["output_tok_s"] for c in figures["vllm-bf16"]["cases"]}
            lines.append("| kvstrata gguf ÷ vLLM bf16 | " + " | ".join(f"{own[c] / vllm[c]:.2f}x" for c in cases) + " |")
        lines.append("")
        first = figures["kvstrata-gguf"]["cases"][0]
        if first.get("memory_read_gb_s"):
            lines += [f"kvstrata gguf, {first['name']}: weights read at {first['weight_gb_s']:.1f} GB/s, "
                      f"{first['weight_gb_s'] / first['memory_read_gb_s']:.0%} of the {first['memory_read_gb_s']:.1f} "
                      "GB/s its run measured (`kvstrata.bench.roofline`)", ""]
        widened = [line for line in figures["kvstrata-gguf"]["log_tail"].splitlines() if " widened to " in line]
        if widened:
            lines += [f"kvstrata's warning: `{widened[0].split('WARNING', 1)[-1].strip()}`", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, help="a shipped shape (dummy weights written as GGUF); "
                                                      "default: the shipped SmolLM2 Q4_1 file")
    parser.add_argument("--files", nargs="+", type=Path, default=None, help="GGUF files (instead of --shape's)")
    parser.add_argument("--types", nargs="+", default=["q8_0", "q4_0"], help="GGUF types of --shape's files")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats within each engine's run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every engine in turn (fastest kept)")
    parser.add_argument("--vllm", action="store_true", help="also vLLM's CPU build in bf16 (the shipped file only)")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 4, 16 tokens, one repeat")
    parser.add_argument("--patience", type=float, default=120)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / time.strftime("gguf-bits-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from kvstrata.bench.cases import write_cases
    from kvstrata.bench.offline import make_cases
    from kvstrata.core.machine import machine
    from kvstrata.model.loader import default_model_path

    if args.quick:
        args.batches, args.length, args.repeats, args.rounds = [1, 4], 16, 1, 1
    args.out.mkdir(parents=True, exist_ok=True)
    if args.vllm and (args.shape or args.files):
        parser.error("--vllm runs the shipped file only (vLLM serves no GGUF on a CPU)")
    servers.install_peers(args.out, ("llamacpp", "vllm") if args.vllm else ("llamacpp",))
    hf_folder = None
    if args.vllm:
        from kvstrata.entrypoints.cli.bench import default_model_folder
        hf_folder = str(default_model_folder())
    prompts = args.out / "prompts.json"
    write_cases(prompts, make_cases(args.batches, args.length, args.length, args.repeats, seed=0))
    files = ({f"{args.shape} {kind}": servers.dummy_gguf(args.shape, kind) for kind in args.types} if args.shape
             else {path.name: path for path in args.files} if args.files
             else {default_model_path().name: default_model_path()})
    report = {"machine": machine().describe(), "date": time.strftime("%Y-%m-%d"), "threads": servers.THREADS,
              "length": args.length, "repeats": args.repeats, "rounds": args.rounds,
              "files": {label: measure(args.out, label.replace(" ", "-"), path, prompts, args.patience, args.rounds,
                                       hf_folder)
                        for label, path in files.items()}}
    (args.out / "gguf_bits.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "gguf_bits.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
