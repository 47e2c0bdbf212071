"""The paged kernel alone, its KV read from memory as in a model step: decodes, and prefill chunks
against torch's SDPA.

    .venv/bin/python benchmarks/paged_kernel.py                 # SmolLM2's shapes, 2 threads
    .venv/bin/python benchmarks/paged_kernel.py --threads 1 --shapes 32x192 16x1040
    .venv/bin/python benchmarks/paged_kernel.py --chunks 512@0 128@512 --shapes   # prefill chunks only

Each layer of a model step reads another layer's cache, so a batch's KV is in memory, not in the
CPU's caches, when the kernel reads it. This cycles the kernel through --layers caches of that
size (SmolLM2: 3 kv heads, 3 query rows each, head dim 64, 16-token blocks) and prints the time per
layer and the rate it reads the KV at, for each sequence's blocks scattered over the cache (as
after hours of traffic) and in order (as in a fresh engine). Compare with the machine's memory read
bandwidth (`kvstrata bench offline` prints it).

--chunks n@c times a prefill chunk of n tokens after c cached ones per layer, both ways the model
can attend it: the kernel's many-rows path (`PagedDecode.rows`, blocks read in place) and what
attention does without the kernel (c = 0: causal SDPA on the chunk's own K/V; else the blocks
gathered, a mask built and masked SDPA), runs interleaved, with the rate each reaches in
attention FLOPs (the pairs each position sees, 4 D FLOPs a pair and query head).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvstrata.model.kernels import PagedDecode, face

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


def chunk_ms(kernel, kvs: list[torch.Tensor], n: int, cached: int, repeat: int) -> tuple[float, float]:
    """Median time of one layer's attention for a chunk of n tokens after `cached`: (kernel, SDPA)."""
    keys, dtype = cached + n, kvs[0].dtype
    table = torch.randperm(kvs[0].shape[2])[:-(-keys // BS)][None]
    q = torch.randn(n, KVH, G, D)
    out, lse = torch.empty_like(q), torch.empty(n, KVH, G)
    starts, lens = torch.tensor([0, n]), torch.tensor([keys])
    qs = q.view(n, KVH * G, D).to(dtype).transpose(0, 1)[None]            # (1, H, n, D), as the model has it
    visible = torch.arange(table.shape[1] * BS)[None] <= torch.arange(cached, keys)[:, None]
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))     # once per step
    own = {id(kv): kv[:, :, table[0]].flatten(2, 3)[:, :, :n].transpose(1, 2).contiguous().transpose(1, 2)
           for kv in kvs if cached == 0}           # a fresh chunk's K/V as the projections leave them: (2, KVH, n, D)

    def sdpa(kv: torch.Tensor) -> None:
        if cached == 0:                                                  # the chunk's own K/V, no gather
            k, v = own[id(kv)]
            F.scaled_dot_product_attention(qs, k[None], v[None], is_causal=True, enable_gqa=True)
        else:                                                            # its blocks gathered, then masked
            gathered = kv[:, :, table[0]].flatten(2, 3)
            F.scaled_dot_product_attention(qs, gathered[0][None], gathered[1][None], attn_mask=mask, enable_gqa=True)

    def rows(kv: torch.Tensor) -> None:
        kernel.rows(q, kv, table, starts, lens, D ** -0.5, out, lse)

    times: dict = {rows: [], sdpa: []}
    for r in range(repeat + 1):
        for fn in times:
            start = time.perf_counter()
            for kv in kvs:
                fn(kv)
            if r:
                times[fn].append((time.perf_counter() - start) / len(kvs))
    return statistics.median(times[rows]) * 1e3, statistics.median(times[sdpa]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["1x600", "32x192", "32x600", "16x1040"],
                        help="decodes: sequences x context")
    parser.add_argument("--chunks", nargs="*", default=["512@0", "1024@0", "128@512", "64@1024"],
                        help="prefill chunks: tokens @ cached tokens before them")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=1500, help="blocks in each layer's cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    kernel = face(PagedDecode)
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
        for chunk in args.chunks:
            n, cached = (int(x) for x in chunk.split("@"))
            assert -(-(n + cached) // BS) <= args.blocks, "--blocks too small for the chunk"
            kernel_ms, sdpa_ms = chunk_ms(kernel, kvs, n, cached, args.repeat)
            gflop = 4 * D * KVH * G * sum(cached + i + 1 for i in range(n)) / 1e9
            print(f"  {name:8} chunk {n:5} after {cached:5}: kernel {kernel_ms:6.2f} ms ({gflop / kernel_ms * 1e3:4.0f}"
                  f" GFLOP/s) | SDPA {sdpa_ms:6.2f} ms ({gflop / sdpa_ms * 1e3:4.0f}) | kernel / SDPA"
                  f" {kernel_ms / sdpa_ms:.2f}", flush=True)


if __name__ == "__main__":
    main()
