"""Accuracy of the int8 model against fp32 (and bf16): perplexity and greedy agreement.

    .venv/bin/python benchmarks/quant_accuracy.py                      # float32 bfloat16 int8
    .venv/bin/python benchmarks/quant_accuracy.py --weights float32 int8 --prompts 8
    .venv/bin/python benchmarks/quant_accuracy.py --weights bfloat16 gguf --llamacpp   # beside llama.cpp
    .venv/bin/python benchmarks/quant_accuracy.py --model gemma-3-270m --weights float32 gguf --llamacpp

`--llamacpp`: llama.cpp's library also scores the same token ids of the same file (the default model's GGUF)
with the same windows (peers/perplexity_llamacpp.py), and each configuration's perplexity is printed over
llama.cpp's: the issue of GGUF bits asks kvstrata's to be within 1% of it on the same file.

Perplexity: the text of benchmarks/data/gpl-3.0.txt (the GNU GPL v3, whose own terms allow verbatim
copies; fixed, English, about 7,700 SmolLM2 tokens), cut into windows of --window tokens, each
scored as its own sequence; exp of the mean negative log-likelihood over every predicted token.

Greedy agreement: --prompts continuation prompts (64-token excerpts of the same text at fixed
offsets), --max-tokens greedy tokens each through the engine (EOS ignored), compared with the first
configuration's:
  * free-running: the share of output positions holding the same token (after a first difference
    the two continuations usually part, so this counts divergence as loss at every later position);
  * identical prefix: mean number of leading output tokens that are the same;
  * teacher-forced top-1: on the reference's own sequence, the share of output positions where the
    other model's argmax is the reference's token (each step judged alone).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from model_step import WEIGHTS

from kvstrata import LLM, SamplingParams
from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from kvstrata.model.network.forward_batch import ForwardBatch

TEXT = Path(__file__).resolve().parent / "data" / "gpl-3.0.txt"
BLOCK = 16


def sequence_logits(model, kv: PagedKVCache, tokens: list[int]) -> torch.Tensor:
    """Logits (N, vocab) of every position of one sequence, prefilled from an empty cache."""
    n = len(tokens)
    table = torch.arange(-(-n // BLOCK)).view(1, -1)
    pos = torch.arange(n)
    batch = ForwardBatch(torch.tensor(tokens), pos, table[0, pos // BLOCK] * BLOCK + pos % BLOCK, table,
                         torch.tensor([n]), [0, n], 0, pos)
    return model(batch, kv)


def perplexity(model, kv: PagedKVCache, tokens: list[int], window: int) -> tuple[float, int]:
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start:start + window]
        if len(chunk) < 2:
            break
        logits = sequence_logits(model, kv, chunk)
        nll += F.cross_entropy(logits[:-1], torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count), count


def gguf_file(model: str | None) -> Path:
    """The GGUF file of `--model`: the default model's, a packaged model's, or the path given."""
    from kvstrata.model.loader import default_model_path
    from kvstrata.model.sources.packaged import PACKAGED, packaged_path

    if model is None:
        return default_model_path()
    return packaged_path(model) if model in PACKAGED else Path(model)


def llamacpp_perplexity(model: str | None, tokens: list[int], window: int, threads: int) -> float:
    """llama.cpp's perplexity of the model's GGUF on `tokens` (peers/perplexity_llamacpp.py)."""
    import servers

    servers.install_peers(Path(tempfile.mkdtemp()), ("llamacpp",))
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "tokens.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"tokens": tokens, "window": window}))
        subprocess.run([str(servers.PEERS / "venvs" / "llamacpp" / "bin" / "python"),
                        str(servers.PEERS / "perplexity_llamacpp.py"), "--model", str(gguf_file(model)),
                        "--tokens", str(job), "--threads", str(threads), "--json", str(out)], check=True)
        return json.loads(out.read_text())["perplexity"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file or a packaged model's name (default: the default model)")
    parser.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llamacpp", action="store_true", help="llama.cpp's perplexity on the same file and tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for name in args.weights:
        dtype, quantization = WEIGHTS[name]
        llm = LLM(model=args.model, dtype=dtype, device="cpu", quantization=quantization, enable_prefix_caching=False,
                  max_model_len=max(args.window, args.prompt_len + args.max_tokens) + 1)
        loaded = llm.engine.loaded
        tokens = loaded.tokenizer(TEXT.read_text())["input_ids"]
        stride = (len(tokens) - args.prompt_len) // args.prompts
        prompts = [tokens[i * stride:i * stride + args.prompt_len] for i in range(args.prompts)]
        kv = PagedKVCache(KVCacheSpec.for_model(loaded.arch, BLOCK, loaded.dtype), -(-args.window // BLOCK))
        start = time.perf_counter()
        with torch.inference_mode():
            ppl, count = perplexity(loaded.model, kv, tokens, args.window)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        outputs = [o.new_token_ids for o in llm.generate(prompts, params)]
        results[name] = (ppl, outputs, loaded.model, kv, prompts)
        print(f"{name:>9}: perplexity {ppl:.4f} over {count} predicted tokens "
              f"({time.perf_counter() - start:.0f} s with the generation)", flush=True)
    if args.llamacpp:
        peer = llamacpp_perplexity(args.model, tokens, args.window, args.threads)
        for name, (ppl, *_) in results.items():
            print(f"{name} vs llama.cpp on the same file: perplexity {ppl:.4f} / {peer:.4f} = {ppl / peer - 1:+.2%}")
    ref_name, (ref_ppl, ref_out, _, _, prompts) = next(iter(results.items()))
    for name, (ppl, outputs, model, kv, _) in list(results.items())[1:]:
        same = sum(a == b for r, o in zip(ref_out, outputs) for a, b in zip(r, o))
        total = sum(len(r) for r in ref_out)
        prefix = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(ref_out, outputs)]
        forced = 0
        with torch.inference_mode():
            for prompt, ref in zip(prompts, ref_out):
                logits = sequence_logits(model, kv, prompt + ref)
                forced += (logits[len(prompt) - 1:-1].argmax(-1) == torch.tensor(ref)).sum().item()
        print(f"{name} vs {ref_name}: perplexity {ppl / ref_ppl - 1:+.2%}; greedy tokens agreeing "
              f"{same / total:.1%} free-running ({same}/{total}), identical prefix "
              f"{sum(prefix) / len(prefix):.1f} of {args.max_tokens} tokens on average "
              f"({sum(p == args.max_tokens for p in prefix)}/{len(prefix)} prompts identical), "
              f"teacher-forced top-1 {forced / total:.1%}")


if __name__ == "__main__":
    main()
