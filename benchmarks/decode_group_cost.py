"""What a decode group costs: attention of k decodes sharing P blocks, grouped against not grouped.

    .venv/bin/python benchmarks/decode_group_cost.py                 # SmolLM2's shapes, 1 thread
    .venv/bin/python benchmarks/decode_group_cost.py --threads 2 --sizes 2 4 16 --dtype bfloat16

One layer's `PagedAttention` call on random K/V (no model): k decodes of P shared blocks plus
40 tokens of their own, once as one `DecodeGroup` and once plain. Prints the fewest CPU
microseconds of one call over --repeat calls (process CPU time, so a busy machine disturbs it
less than wall time) and the difference; where it turns negative the group pays. Where the paged
kernel builds, decodes read their blocks in place; KVSTRATA_KERNELS=0 times the gathered path,
the evidence behind kvstrata.kvcache.prefix_groups.GROUP_COST_TOKENS. The in-place threshold
(IN_PLACE_GROUP_COST_TOKENS) comes from whole model steps, KV in memory, not one hot layer:
benchmarks/model_step.py --shared-prefix with --group-cost-tokens 0 and 10**9.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvstrata.model.kernels import PagedDecode, face
from kvstrata.model.network.attention import PagedAttention
from kvstrata.model.network.forward_batch import DecodeGroup, ForwardBatch

BLOCK, KV_HEADS, GROUP, HEAD_DIM, NUM_BLOCKS = 16, 3, 3, 64, 4000     # SmolLM2-135M
OWN_TOKENS = 40


def decodes(k: int, shared: int, grouped: bool, gen: torch.Generator) -> ForwardBatch:
    ctx = shared * BLOCK + OWN_TOKENS
    per_seq = -(-ctx // BLOCK)
    ids = torch.randperm(NUM_BLOCKS - 1, generator=gen)[:shared + k * (per_seq - shared)] + 1
    tables = torch.cat([ids[:shared].expand(k, -1), ids[shared:].view(k, -1)], dim=1)
    zeros = torch.zeros(k, dtype=torch.int64)
    return ForwardBatch(zeros, torch.full((k,), ctx - 1), zeros, tables, torch.full((k,), ctx),
                        list(range(k + 1)), k, torch.arange(k), [DecodeGroup(0, k, shared)] if grouped else [])


def cpu_us(attn: PagedAttention, batch: ForwardBatch, kv: torch.Tensor, repeat: int) -> float:
    plan = attn.plan(batch, BLOCK, NUM_BLOCKS, kv.dtype)
    q = torch.randn(batch.num_seqs, KV_HEADS * GROUP, HEAD_DIM).to(kv.dtype)      # as the model has it
    k = q[:, :KV_HEADS]                                  # unused by decodes: their K/V are in the cache
    for _ in range(20):
        attn(q, k, k, kv, plan)
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        attn(q, k, k, kv, plan)
        best = min(best, time.process_time() - start)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=int, default=[2, 4], help="decodes per group")
    parser.add_argument("--blocks", nargs="+", type=int, default=[1, 4, 8, 16, 32], help="shared blocks")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the KV cache's dtype")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    attn = PagedAttention(KV_HEADS * GROUP, KV_HEADS, HEAD_DIM, face(PagedDecode))   # None: KVSTRATA_KERNELS=0
    kv = torch.randn(2, KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM).to(getattr(torch, args.dtype))   # one layer
    print(f"{args.threads} thread(s), {args.dtype}, block {BLOCK}, {OWN_TOKENS} own tokens per decode; CPU us per layer")
    for k in args.sizes:
        for shared in args.blocks:
            plain = cpu_us(attn, decodes(k, shared, False, gen), kv, args.repeat)
            grouped = cpu_us(attn, decodes(k, shared, True, gen), kv, args.repeat)
            print(f"  {k:3d} decodes, {shared:3d} shared blocks (saves {(k - 1) * shared * BLOCK:5d} tokens): "
                  f"plain {plain:7.1f}  grouped {grouped:7.1f}  difference {grouped - plain:+7.1f}")


if __name__ == "__main__":
    main()
