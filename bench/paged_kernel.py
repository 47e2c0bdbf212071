"""The paged decode kernel alone, its KV read from memory as in a model step.

    .venv/bin/python bench/paged_kernel.py                 # SmolLM2's shapes, 2 threads
    .venv/bin/python bench/paged_kernel.py --threads 1 --shapes 32x192 16x1040

Each layer of a model step reads another layer's cache, so a batch's KV is in memory, not in the
CPU's caches, when the kernel reads it. This cycles the kernel through --layers caches of that
size (SmolLM2: 3 kv heads, 3 query rows each, head dim 64, 16-token blocks) and prints the time per
layer and the rate it reads the KV at, for each sequence's blocks scattered over the cache (as
after hours of traffic) and in order (as in a fresh engine). Compare with the machine's memory read
bandwidth (`kvstrata bench offline` prints it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvstrata.model.kernels import paged_decode

KVH, G, D, BS = 3, 3, 64, 16


def per_layer_us(kernel, kvs: list[torch.Tensor], tables: torch.Tensor, lens: torch.Tensor, repeat: int) -> float:
    """Median time of one layer's call, cycling through every cache `repeat` times (first pass untimed)."""
    n = tables.shape[0]
    q = torch.randn(n, KVH, G, D)
    out, lse, first = torch.empty_like(q), torch.empty(n, KVH, G), torch.zeros(n, dtype=torch.int64)
    times = []
    for r in range(repeat + 1):
        start = time.perf_counter()
        for kv in kvs:
            kernel(q, kv, tables, first, lens, D ** -0.5, out, lse)
        if r:
            times.append((time.perf_counter() - start) / len(kvs))
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1x600", "32x192", "32x600", "16x1040"],
                        help="sequences x context")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=1500, help="blocks in each layer's cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    kernel = paged_decode()
    if kernel is None:
        raise SystemExit("the paged kernel is unavailable here (no C++ compiler, or KVSTRATA_KERNELS=0)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.threads} threads, {args.layers} layers' caches of {args.blocks} blocks; per layer call:")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        kvs = [torch.randn(2, KVH, args.blocks, BS, D, generator=gen).to(dtype) for _ in range(args.layers)]
        for shape in args.shapes:
            n, ctx = (int(x) for x in shape.split("x"))
            nb = -(-ctx // BS)
            assert n * nb <= args.blocks, "--blocks too small for the shape"
            lens = torch.full((n,), ctx, dtype=torch.int64)
            kv_bytes = n * ctx * KVH * 2 * D * dtype.itemsize
            cells = []
            for layout, ids in (("scattered", torch.randperm(args.blocks, generator=gen)),
                                ("in order", torch.arange(args.blocks))):
                us = per_layer_us(kernel, kvs, ids[:n * nb].view(n, nb), lens, args.repeat)
                cells.append(f"{layout} {us:7.0f} us {kv_bytes / us / 1e3:5.1f} GB/s")
            print(f"  {name:8} {n:3} x {ctx:5}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
