"""The GPU check: kvstrata on a CUDA machine, in under 8 minutes, with nothing installed but what it names.

    PYTHONPATH=. python3 benchmarks/device_check.py --smollm2 SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python benchmarks/device_check.py --write-reference      # here, on a CPU: the reference

1. The CUDA-marked tests (`pytest -m cuda`: the model, the engine with its host tier and the disk
   store, pinned copies).
2. Greedy SmolLM2 on CUDA equals the CPU's, token for token, in float32: 8 chat prompts, up to 32 tokens,
   against the CPU of the same machine and against the reference this script wrote on the project's
   CPU machine (benchmarks/data/smollm2_greedy_reference.json; another torch may differ there, and
   says so).
3. Decode throughput at the llama-3.2-1b shape (dummy weights, bf16): batch 1 and 32, each the
   output tokens after the first over the time after the first, beside the weights' bytes read per
   second (the roofline of a decode step); and one 2,048-token prefill.

Each part has a deadline and its failure does not stop the others; the summary goes to stdout and,
as JSON, to `--out`. Needs torch with CUDA, transformers, tokenizers, safetensors, numpy, xxhash,
jinja2, pytest and hypothesis, and the pure-Python `gguf` (carried as a wheel where it is missing).
Never part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "benchmarks" / "data" / "smollm2_greedy_reference.json"
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about rain.",
             "What is 17 times 23?", "Explain what a prime number is.", "Translate 'good morning' into Spanish.",
             "Give one tip for sleeping well.", "What does a compiler do?"]
GREEDY_TOKENS = 32
DECODE_TOKENS = 128


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def greedy_smollm2(gguf: str | None, device: str) -> list[list[int]]:
    from kvstrata import LLM, SamplingParams
    with LLM(gguf, device=device, dtype="float32", kv_cache_memory="256MiB", enable_prefix_caching=False) as llm:
        params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0)
        return [out.new_token_ids for out in llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)]


def cuda_tests(timeout: float) -> dict:
    start = time.perf_counter()
    # Only the files that hold CUDA tests: collecting the others would import the server's libraries.
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "@cuda_only" in p.read_text())
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *files],
                         cwd=REPO, capture_output=True, text=True, timeout=timeout)
    print(run.stdout[-4000:], run.stderr[-2000:], flush=True)
    summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    return {"exit": run.returncode, "summary": summary, "seconds": round(time.perf_counter() - start, 1)}


def smollm2_parity(gguf: str | None, device: str) -> dict:
    import torch
    cuda = greedy_smollm2(gguf, device)
    cpu = greedy_smollm2(gguf, "cpu")
    result = {"prompts": len(QUESTIONS), "cuda_equals_cpu": cuda == cpu,
              "rows_differing_from_cpu": sum(a != b for a, b in zip(cuda, cpu))}
    if REFERENCE.is_file():
        reference = json.loads(REFERENCE.read_text())
        result["reference_machine"] = reference["machine"]
        result["cuda_equals_reference"] = cuda == reference["token_ids"]
        result["rows_differing_from_reference"] = sum(a != b for a, b in zip(cuda, reference["token_ids"]))
        result["torch_here_vs_reference"] = f"{torch.__version__} vs {reference['torch']}"
    return result


def decode_speed(model: str, device: str, tokenizer: str | None) -> dict:
    import torch

    from kvstrata import LLM, SamplingParams
    cuda = device == "cuda"
    llm = LLM(model, load_format="dummy", tokenizer=tokenizer, device=device, dtype="bfloat16",
              kv_cache_memory="16GiB" if cuda else "1GiB", enable_prefix_caching=False, max_num_seqs=64,
              max_num_batched_tokens=4096)
    weight_bytes = llm.engine.loaded.model.step_weight_bytes()
    figures: dict = {"model": model, "device": torch.cuda.get_device_name() if cuda else "cpu",
                     "weight_bytes": weight_bytes, "torch": torch.__version__}

    def timed(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed([list(range(1000, 1128))] * 2, 8)                                             # warm-up
    for batch in (1, 32):
        prompts = [list(range(1000 + 7 * i, 1128 + 7 * i)) for i in range(batch)]      # 128 tokens each
        first = timed(prompts, 1)
        whole = timed(prompts, DECODE_TOKENS)
        step = (whole - first) / (DECODE_TOKENS - 1)
        figures[f"batch_{batch}"] = {"output_tok_s": round(batch / step, 1), "step_ms": round(step * 1e3, 2),
                                     "weights_gb_s": round(weight_bytes / step / 1e9, 1)}
        log(f"decode batch {batch}: {batch / step:.1f} tok/s, {step * 1e3:.2f} ms a step, "
            f"{weight_bytes / step / 1e9:.1f} GB/s of weights")
    prefill = timed([list(range(2000, 4048))], 1)
    figures["prefill_2048_s"] = round(prefill, 3)
    figures["prefill_tok_s"] = round(2048 / prefill, 1)
    llm.close()
    return figures


def write_reference() -> None:
    import torch

    from kvstrata.core.machine import machine
    REFERENCE.write_text(json.dumps({"machine": machine().describe(), "torch": torch.__version__,
                                     "questions": QUESTIONS, "max_tokens": GREEDY_TOKENS,
                                     "token_ids": greedy_smollm2(None, "cpu")}) + "\n")
    log(f"wrote {REFERENCE}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2", help="the SmolLM2-135M-Instruct GGUF (default: the installed one)")
    parser.add_argument("--model", default="llama-3.2-1b", help="dummy shape for the decode figures")
    parser.add_argument("--out", help="folder for device_check.json")
    parser.add_argument("--tests-timeout", type=float, default=180)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself on a machine without a GPU")
    parser.add_argument("--write-reference", action="store_true", help="write the CPU reference and stop")
    args = parser.parse_args()
    os.environ.setdefault("KVSTRATA_CACHE_DIR", "/tmp/kvstrata-device-check")
    if args.write_reference:
        write_reference()
        return 0
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: nothing to check")
        return 2
    if args.device == "cuda":
        log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    parts = {"cuda_tests": lambda: cuda_tests(args.tests_timeout),
             "smollm2_greedy": lambda: smollm2_parity(args.smollm2, args.device) if args.smollm2 or _installed()
             else {"skipped": "no SmolLM2 GGUF (--smollm2)"},
             "decode": lambda: decode_speed(args.model, args.device, args.smollm2)}
    summary: dict = {}
    for name, part in parts.items():
        log(f"{name} ...")
        start = time.perf_counter()
        try:
            summary[name] = part()
        except Exception as exc:                   # one part's failure is reported, the others still run
            traceback.print_exc()
            summary[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        log(f"{name} in {time.perf_counter() - start:.1f}s: {json.dumps(summary[name])}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "device_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    failed = summary["cuda_tests"].get("exit") != 0 or summary["smollm2_greedy"].get("cuda_equals_cpu") is False \
        or "error" in json.dumps(summary)
    return 1 if failed else 0


def _installed() -> bool:
    from kvstrata.model.loader import default_model_path
    try:
        default_model_path()
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
