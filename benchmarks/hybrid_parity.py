"""A hybrid model's per-token log-likelihoods against transformers on the same file: Gemma 3 270M (Q4_K_M, the
packaged real weights) in float32 (`--dtype float32 --quantization none`), over a text several sliding windows
long, prefilled in chunks that straddle the windows' edges and then a stretch of decodes.

    .venv/bin/python benchmarks/hybrid_parity.py                         # 2,000 tokens of the GPL's text
    .venv/bin/python benchmarks/hybrid_parity.py --tokens 600 --model gemma-3-270m

transformers reads the GGUF itself (its own dequantization, its Gemma3ForCausalLM with the sliding-window mask),
so the two share nothing but the file. Prints the max and mean |difference| of log p(next token) over every
position (the issue's bar: 0.02 and 0.002 nats), and where the largest is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstrata.core.config import ModelConfig  # noqa: E402
from kvstrata.core.machine import machine  # noqa: E402
from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache  # noqa: E402
from kvstrata.model.loader import load_model  # noqa: E402
from kvstrata.model.network.forward_batch import ForwardBatch  # noqa: E402
from kvstrata.model.sources.packaged import PACKAGED, packaged_path  # noqa: E402

TEXT = ROOT / "benchmarks" / "data" / "gpl-3.0.txt"
BLOCK = 16


def step(model, kv: PagedKVCache, tokens: list[int], start: int, end: int) -> torch.Tensor:
    """Logits of positions [start, end) of one sequence whose earlier positions are in `kv` (blocks 0, 1, ...)."""
    table = torch.arange(kv.num_blocks).view(1, -1)
    pos = torch.arange(start, end)
    n = end - start
    batch = ForwardBatch(torch.tensor(tokens[start:end]), pos, table[0, pos // BLOCK] * BLOCK + pos % BLOCK, table,
                         torch.tensor([end]), [0, n], 1 if n == 1 else 0, torch.arange(n))
    return model(batch, kv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=384, help="prefill chunk (the window is 512)")
    parser.add_argument("--decodes", type=int, default=64, help="the last positions, one a step")
    args = parser.parse_args()
    import transformers

    path = packaged_path(args.model) if args.model in PACKAGED else Path(args.model)
    loaded = load_model(ModelConfig(model=args.model, dtype="float32", quantization="none"))
    tokens = loaded.tokenizer(TEXT.read_text())["input_ids"][:args.tokens]
    assert len(tokens) == args.tokens, f"the text has {len(tokens)} tokens"
    print(f"machine: {machine().describe()}; {loaded.name}: {loaded.describe()}, windows "
          f"{sorted({w for w in loaded.arch.windows if w})}", flush=True)
    start = time.perf_counter()
    kv = PagedKVCache(KVCacheSpec.for_model(loaded.arch, BLOCK, loaded.dtype), -(-len(tokens) // BLOCK))
    logits, at, prefill_end = [], 0, len(tokens) - args.decodes
    with torch.inference_mode():
        while at < len(tokens):
            end = min(at + args.chunk, prefill_end) if at < prefill_end else at + 1
            logits.append(step(loaded.model, kv, tokens, at, end))
            at = end
    ours = torch.log_softmax(torch.cat(logits).double(), -1)
    print(f"kvstrata: {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.inference_mode():
        reference = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].double(), -1)
    print(f"transformers: {time.perf_counter() - start:.1f} s", flush=True)
    picked = torch.tensor(tokens[1:])[:, None]
    diff = (ours[:-1].gather(1, picked) - reference[:-1].gather(1, picked)).abs()[:, 0]
    worst = int(diff.argmax())
    print(f"{len(tokens) - 1} positions (chunks of {args.chunk}, then {args.decodes} decodes): log p(next) |diff| "
          f"max {float(diff.max()):.2e} nats (position {worst}), mean {float(diff.mean()):.2e}; "
          f"greedy agreement {float((ours[:-1].argmax(-1) == reference[:-1].argmax(-1)).double().mean()):.2%}")


if __name__ == "__main__":
    main()
