"""vLLM (CPU build) with `enable_lora`: the same token-id prompts as benchmarks/lora_mixed.py, base only
and mixed evenly over the base and the adapters (a `LoRARequest` per prompt), ignore_eos, greedy,
prefix caching off (as in kvstrata's run: the repeats send the same prompts).
Writes --json: {"base": [seconds per repeat], "mixed": [...], "version": ...}.
Run by benchmarks/lora_mixed.py in vLLM's venv (benchmarks/peers/install_vllm.sh)."""

import argparse
import json
import time

import vllm
from vllm.lora.request import LoRARequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapters", nargs="+", required=True)
    parser.add_argument("--prompts", required=True, help="a JSON list of token-id lists")
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", required=True, help="where to write the figures")
    args = parser.parse_args()
    prompts = json.load(open(args.prompts))
    llm = vllm.LLM(model=args.model, dtype=args.dtype, max_model_len=2048, max_num_seqs=64, seed=0, enable_lora=True,
                   enable_prefix_caching=False,
                   max_loras=len(args.adapters), max_lora_rank=args.max_lora_rank)
    requests = [None] + [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(args.adapters)]
    params = vllm.SamplingParams(temperature=0, max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True)
    token_prompts = [vllm.TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(token_prompts[:len(requests)], params, lora_request=requests, use_tqdm=False)     # warm every adapter
    seconds = {"base": [], "mixed": []}
    for _ in range(args.repeats):
        for kind in ("base", "mixed"):
            loras = [requests[i % len(requests)] if kind == "mixed" else None for i in range(len(prompts))]
            start = time.perf_counter()
            outs = llm.generate(token_prompts, params, lora_request=loras, use_tqdm=False)
            seconds[kind].append(time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    with open(args.json, "w") as out:
        json.dump({**seconds, "version": vllm.__version__}, out)
    print(f"vllm {vllm.__version__}: {seconds}", flush=True)


if __name__ == "__main__":
    main()
