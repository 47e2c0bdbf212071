"""LoRA adapters batched with the base model: output throughput of 32 streams mixed evenly over the
base and 4 adapters, against the base model alone, in kvstrata and in vLLM's CPU build (same token-id
prompts, same adapters, greedy, ignore_eos), repeats alternating.

    .venv/bin/python benchmarks/lora_mixed.py [--streams 32] [--rank 16] [--repeats 3] [--no-vllm]

The adapters are made here with PEFT (random A, non-zero random B, all seven targets) on the embedded
SmolLM2's HF folder, under benchmarks/results/lora/. vLLM runs from benchmarks/peers/venvs/vllm
(benchmarks/peers/install_vllm.sh) in a child process with OMP_NUM_THREADS = --threads.
Prints each engine's output tok/s (fastest repeat, and the median) and the ratios the issue asks for.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstrata.core.config import EngineConfig, ModelConfig  # noqa: E402
from kvstrata.core.machine import machine  # noqa: E402
from kvstrata.core.sampling_params import SamplingParams  # noqa: E402
from kvstrata.engine.llm_engine import LLMEngine  # noqa: E402
from kvstrata.model.loader import load_model  # noqa: E402
from tests.model.lora_helpers import save_peft_adapter  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "lora"
VLLM = ROOT / "benchmarks" / "peers" / "venvs" / "vllm" / "bin" / "python"


def make_adapters(folder: Path, count: int, rank: int) -> list[Path]:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    paths = []
    for index in range(count):
        path = OUT / f"adapter-r{rank}-{index}"
        if not (path / "adapter_model.safetensors").exists():
            save_peft_adapter(folder, path, seed=index + 1, rank=rank, alpha=2 * rank, scale=0.05, base=base)
        paths.append(path)
    return paths


def run_kvstrata(engine: LLMEngine, prompts: list[list[int]], names: list[str | None], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params, lora=names)
    seconds = time.perf_counter() - start
    assert all(len(o.new_token_ids) == output_len for o in outs)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-vllm", action="store_true", help="kvstrata only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine().describe()}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    loaded = load_model(ModelConfig(dtype=args.dtype, threads=args.threads))
    adapters = make_adapters(loaded.folder, args.adapters, args.rank)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.input_len)] for _ in range(args.streams)]
    names = [None] + [f"a{i}" for i in range(args.adapters)]
    mixed = [names[i % len(names)] for i in range(args.streams)]
    engine = LLMEngine(EngineConfig.from_options(
        dtype=args.dtype, kv_cache_memory="1GiB", max_num_seqs=64, enable_prefix_caching=False,
        lora_modules=tuple(f"a{i}={p}" for i, p in enumerate(adapters)), max_loras=args.adapters,
        max_lora_rank=args.rank), loaded=loaded)
    run_kvstrata(engine, prompts[:len(names)], names, 4)                                   # warm up
    seconds = {"base": [], "mixed": []}
    for repeat in range(args.repeats):
        for kind in ("base", "mixed") if repeat % 2 == 0 else ("mixed", "base"):
            seconds[kind].append(run_kvstrata(engine, prompts, mixed if kind == "mixed" else [None] * len(prompts),
                                              args.output_len))
            print(f"kvstrata {kind} repeat {repeat}: {seconds[kind][-1]:.2f} s", flush=True)
    results = {"kvstrata": seconds}
    if not args.no_vllm:
        if not VLLM.exists():
            sys.exit(f"no vLLM at {VLLM}: run benchmarks/peers/install_vllm.sh, or pass --no-vllm")
        (OUT / "prompts.json").write_text(json.dumps(prompts))
        del engine
        child = subprocess.run([str(VLLM), str(ROOT / "benchmarks/peers/offline_vllm_lora.py"), "--model",
                                str(loaded.folder), "--prompts", str(OUT / "prompts.json"), "--output-len",
                                str(args.output_len), "--max-lora-rank", str(args.rank), "--repeats",
                                str(args.repeats), "--dtype", args.dtype, "--json", str(OUT / "vllm.json"),
                                "--adapters", *map(str, adapters)],
                               capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads),
                                                                    "VLLM_CPU_KVCACHE_SPACE": "2"})
        if child.returncode != 0:
            sys.exit(f"vLLM failed:\n{child.stderr[-3000:]}")
        vllm_result = json.loads((OUT / "vllm.json").read_text())
        results["vllm"] = {"base": vllm_result["base"], "mixed": vllm_result["mixed"]}
        print(f"vllm {vllm_result['version']}", flush=True)
    tokens = args.streams * args.output_len
    rate = {(engine_name, kind): tokens / min(s) for engine_name, by in results.items() for kind, s in by.items()}
    print(f"\n{args.streams} streams, {args.input_len} in / {args.output_len} out, {args.adapters} adapters of rank "
          f"{args.rank} (all 7 targets) mixed evenly with the base, {args.dtype}, {args.threads} threads")
    print(f"{'engine':10} {'kind':6} {'output tok/s (best)':>20} {'median':>8}")
    for (engine_name, kind), value in rate.items():
        median = tokens / statistics.median(results[engine_name][kind])
        print(f"{engine_name:10} {kind:6} {value:20.1f} {median:8.1f}")
    print(f"kvstrata mixed / kvstrata base: {rate[('kvstrata', 'mixed')] / rate[('kvstrata', 'base')]:.3f}")
    if "vllm" in results:
        print(f"kvstrata mixed / vllm mixed: {rate[('kvstrata', 'mixed')] / rate[('vllm', 'mixed')]:.3f}")
        print(f"vllm mixed / vllm base: {rate[('vllm', 'mixed')] / rate[('vllm', 'base')]:.3f}")
    (OUT / "lora_mixed.json").write_text(json.dumps({"args": vars(args), "seconds": results}, indent=1))


if __name__ == "__main__":
    main()
