"""Time one model step (decode at several batch sizes, prefill) on the default model.

    .venv/bin/python benchmarks/model_step.py                       # fp32, bf16 and int8, 2 threads
    .venv/bin/python benchmarks/model_step.py --dtypes bfloat16 --batches 32 --profile
    .venv/bin/python benchmarks/model_step.py --dtypes float32 int8 --batches 1 8 --profile
    .venv/bin/python benchmarks/model_step.py --hf          # transformers on the same weights, same shapes
    .venv/bin/python benchmarks/model_step.py --dtypes float32 --batches 16 --ctx 1040 --shared-prefix 1024
    .venv/bin/python benchmarks/model_step.py --dtypes bfloat16 --batches 16 --ctx 1040 --in-order --prefills
    .venv/bin/python benchmarks/model_step.py --dtypes int8 --batches 1 8 --compile --profile
    .venv/bin/python benchmarks/model_step.py --model FILE.gguf --dtypes gguf bfloat16 --batches 1 --prefills --profile

--shared-prefix N gives every decoding sequence the same first N tokens' blocks (as prefix caching
leaves them) and the runner's decode groups (kvstrata.kvcache.prefix_groups), so attention reads
them once per group where a group pays; --group-cost-tokens 0 groups them always, 10**9 never
(the evidence behind IN_PLACE_GROUP_COST_TOKENS). Decodes' blocks are scattered over the cache
(as after hours of traffic) unless --in-order (consecutive, as a fresh engine allocates them; the
kernel reads them faster, see benchmarks/paged_kernel.py). --profile prints, per run, the time spent
gathering KV blocks and in the rest of attention beside the whole step, then the op table.

Each figure is the fastest of --repeat steps after warm-up (on a shared 2-core machine the median
mostly measures the neighbours; it is printed too), beside what the step had to read: the weights
(GB/s of weights per second is the roofline figure on a CPU) and the KV. "int8" is float32 with
`quantization="int8"`. --compile also times each of them with `--compile` (kvstrata.model.network.compiled),
as "<name>+c", and prints how long its compile took. The models are loaded first and timed in turn for each shape, so a
neighbour's burst hits all of them alike. --profile also counts the torch ops one step dispatches.
Decode steps use a cache of zeros with shuffled block tables: timing does not depend on values.
--json PATH also writes every fastest and median time (`make bench` times one fixed step so at
its start and end: the host probe in BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import torch

from kvstrata.bench.roofline import memory_read_bandwidth
from kvstrata.core.config import ModelConfig
from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from kvstrata.kvcache.prefix_groups import group_cost_tokens, group_decodes
from kvstrata.model.loader import load_model
from kvstrata.model.network.attention import PagedAttention
from kvstrata.model.network.forward_batch import ForwardBatch

BLOCK = 16


def decode_batch(batch: int, ctx: int, num_blocks: int, gen: torch.Generator, shared: int = 0,
                 group_cost: int = group_cost_tokens(in_place=True), in_order: bool = False) -> ForwardBatch:
    """`batch` decodes at `ctx` tokens of context; the first `shared` tokens' whole blocks are the same
    block ids in every table (grouped as `group_decodes` groups them at `group_cost`), the rest are
    each sequence's own. Block ids are drawn at random (a cache after hours of traffic) or, `in_order`,
    consecutive (a fresh engine's first allocations)."""
    per_seq, common = -(-ctx // BLOCK), shared // BLOCK
    assert common < per_seq, "each sequence needs a block of its own for the token it decodes"
    ids = torch.arange(num_blocks) if in_order else torch.randperm(num_blocks, generator=gen)
    own = ids[common:common + batch * (per_seq - common)].view(batch, per_seq - common)
    tables = torch.cat([ids[:common].expand(batch, common), own], dim=1)
    order, groups = group_decodes(tables.tolist(), [ctx] * batch, BLOCK, group_cost)
    tables = tables[order]
    pos = torch.full((batch,), ctx - 1)
    slots = tables[:, (ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK
    return ForwardBatch(torch.randint(0, 1000, (batch,), generator=gen), pos, slots, tables,
                        torch.full((batch,), ctx), list(range(batch + 1)), batch, torch.arange(batch), groups)


def prefill_batch(n: int, num_blocks: int, gen: torch.Generator) -> ForwardBatch:
    per_seq = -(-n // BLOCK)
    table = torch.randperm(num_blocks, generator=gen)[:per_seq].view(1, per_seq)
    pos = torch.arange(n)
    slots = table[0, pos // BLOCK] * BLOCK + pos % BLOCK
    return ForwardBatch(torch.randint(0, 1000, (n,), generator=gen), pos, slots, table,
                        torch.tensor([n]), [0, n], 0, torch.tensor([n - 1]))


WEIGHTS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "int8": ("float32", "int8"),
           "gguf": ("bfloat16", "gguf")}      # gguf: the file's own bits (kvstrata.model.formats.gguf)


def label_attention() -> None:
    """Wrap PagedAttention's gather and its whole call in profiler ranges, so a profile splits a step."""
    for name, label in (("_gather", "kv gather"), ("__call__", "attention")):
        method = getattr(PagedAttention, name)

        def labelled(self, *args, _method=method, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _method(self, *args, **kwargs)
        setattr(PagedAttention, name, labelled)


def profile_step(name: str, model, batch, kv) -> None:
    """One profiled step: ops dispatched, gather and attention (without the gather) beside the whole
    step, then the op table."""
    with torch.profiler.profile() as prof:
        start = time.perf_counter()
        model(batch, kv)
        step = time.perf_counter() - start
    top = [e for e in prof.events() if e.cpu_parent is None]
    ranges = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    gather, attention = ranges.get("kv gather", 0.0), ranges.get("attention", 0.0)
    print(f"  {name:>9}: {len(top)} torch ops dispatched per step ({len(prof.events())} with the ops they call); "
          f"profiled step {step * 1e3:.1f} ms: KV gather {gather:.1f} ms ({gather / step / 10:.0f}%), "
          f"attention without the gather {attention - gather:.1f} ms ({(attention - gather) / step / 10:.0f}%)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


class Timed:
    """A callable that adds its wall time to `totals[kind]` (the breakdown's projections and attention)."""

    def __init__(self, call, kind: str, totals: dict[str, float]) -> None:
        self.call, self.kind, self.totals = call, kind, totals

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.call(*args, **kwargs)
        self.totals[self.kind] += time.perf_counter() - start
        return out

    def __getattr__(self, name: str):          # the rest of the wrapped object (attention's plan)
        return getattr(self.call, name)


def breakdown_step(model, batch, kv, repeat: int) -> dict[str, float]:
    """Seconds of the fastest of `repeat` steps: whole, in projections and the head, in attention (with RoPE and
    the K/V write where one call does all three), the rest. The fused layers' parts come from their own clock."""
    totals = {"weights": 0.0, "attention": 0.0}
    layers, head, attn = model.layers, model.head, model.attn
    saved = [dict(layer.projections) for layer in layers]
    for layer in layers:
        layer.projections = {name: Timed(p, "weights", totals) for name, p in layer.projections.items()}
    model.head, model.attn = Timed(head, "weights", totals), Timed(attn, "attention", totals)
    # the kernel loop (kvstrata.model.network.steps): RoPE with the K/V write, then the kernel's attention
    attn.attend_rotated = Timed(attn.attend_rotated, "attention", totals)
    norm_act = model.norm_act
    if norm_act is not None:
        norm_act.rope_store = Timed(norm_act.rope_store, "attention", totals)
    fused = getattr(model.loop, "fused", None)   # the layers in one C++ call (network.fused): its own clock
    if fused is not None:
        fused.seconds = (ctypes.c_double * 3)()
    try:
        best = None
        for index in range(repeat + 3):
            totals.update(weights=0.0, attention=0.0)
            if fused is not None:
                ctypes.memset(fused.seconds, 0, ctypes.sizeof(fused.seconds))
            start = time.perf_counter()
            model(batch, kv)
            step = {"step": time.perf_counter() - start, **totals}
            if fused is not None:
                step["weights"] += fused.seconds[0]
                step["attention"] += fused.seconds[1]
            if index >= 3 and (best is None or step["step"] < best["step"]):
                best = step
    finally:
        for layer, projections in zip(layers, saved):
            layer.projections = projections
        model.head, model.attn = head, attn
        del attn.attend_rotated
        if norm_act is not None:
            del norm_act.rope_store
        if fused is not None:
            fused.seconds = None
    return {**best, "rest": best["step"] - best["weights"] - best["attention"]}


def print_breakdown(name: str, parts: dict[str, float], weight_bytes: int, bandwidth: float) -> None:
    step = parts["step"]
    print(f"  {name:>9}  breakdown of a timed step {step * 1e3:.2f} ms: weights {parts['weights'] * 1e3:.2f} ms "
          f"({weight_bytes / parts['weights'] / 1e9:.1f} GB/s, {weight_bytes / parts['weights'] / bandwidth:.0%} of "
          f"{bandwidth / 1e9:.1f} measured), attention {parts['attention'] * 1e3:.2f} ms, "
          f"everything else {parts['rest'] * 1e3:.2f} ms ({parts['rest'] / step:.0%})")


def time_step(model, batch, kv, repeat: int) -> tuple[float, float]:
    """(fastest, median) seconds of one step."""
    for _ in range(3):
        model(batch, kv)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        model(batch, kv)
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def hf_decode_step(folder, dtype: torch.dtype, batch: int, ctx: int, repeat: int) -> tuple[float, float]:
    """transformers' LlamaForCausalLM, one decode step at `batch` x `ctx` with its DynamicCache."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        out = hf(torch.randint(0, 1000, (batch, ctx - 1), generator=gen), use_cache=True)
        cache, token = out.past_key_values, torch.randint(0, 1000, (batch, 1), generator=gen)
        times = []
        for _ in range(repeat + 3):
            start = time.perf_counter()
            hf(token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return min(times[3:]), statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--ctx", type=int, default=192, help="context of every decoding sequence")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens at the start of every decode's context held in the same blocks")
    parser.add_argument("--group-cost-tokens", type=int, default=group_cost_tokens(in_place=True),
                        help="what a decode group must save to be formed (0: always group a shared prefix; "
                             "default: the runner's with the paged kernel)")
    parser.add_argument("--in-order", action="store_true",
                        help="decodes' blocks consecutive, as a fresh engine allocates them (default: scattered)")
    parser.add_argument("--prefills", nargs="*", type=int, default=[128, 512])
    parser.add_argument("--model", default=None, help="a model other than the default (a GGUF file for gguf)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler op table per run")
    parser.add_argument("--compile", action="store_true", help="also time each model with --compile")
    parser.add_argument("--hf", action="store_true", help="also time transformers' decode step")
    parser.add_argument("--batch-invariant", action="store_true", help="load the models with --batch-invariant")
    parser.add_argument("--breakdown", action="store_true",
                        help="split each decode step: projections (weights read), attention, everything else")
    parser.add_argument("--json", type=Path, default=None, help="also write every timing here (make bench's host probe)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        label_attention()
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, decode ctx {args.ctx} "
          f"({args.shared_prefix} shared), block {BLOCK}, blocks {'in order' if args.in_order else 'scattered'}")
    models = {}
    for name, compile_ in [(n, c) for n in args.dtypes for c in (False, True) if c <= args.compile]:
        dtype, quantization = WEIGHTS[name]
        start = time.perf_counter()
        chosen = {} if args.model is None else {"model": args.model}
        loaded = load_model(ModelConfig(**chosen, dtype=dtype, device="cpu", quantization=quantization, compile=compile_,
                                        batch_invariant=args.batch_invariant))
        name = f"{name}+c" if compile_ else name
        name = f"{name}/bi" if args.batch_invariant else name
        if compile_:
            print(f"{name}: loaded and compiled in {time.perf_counter() - start:.1f} s")
        spec = KVCacheSpec.for_model(loaded.arch, BLOCK, loaded.dtype)
        num_blocks = max(max(args.batches) * -(-args.ctx // BLOCK), -(-max(args.prefills, default=0) // BLOCK)) + 1
        models[name] = (loaded.model, PagedKVCache(spec, num_blocks), loaded.model.step_weight_bytes())
        print(f"{name}: weights read per step {models[name][2] / 1e6:.0f} MB, "
              f"KV {spec.bytes_per_block / 1e3:.0f} kB/block")
    runs = [(f"decode  batch {b:4d}", decode_batch(b, args.ctx, num_blocks, gen, args.shared_prefix,
                                                  args.group_cost_tokens, args.in_order), b)
            for b in args.batches]
    runs += [(f"prefill {n:4d} tokens", prefill_batch(n, num_blocks, gen), n) for n in args.prefills]
    bandwidth = memory_read_bandwidth() if args.breakdown else 0.0
    if args.breakdown:
        print(f"memory read bandwidth measured: {bandwidth / 1e9:.1f} GB/s")
    timings = []
    for label, batch, tokens in runs:
        print(f"\n{label}")
        for name, (model, kv, weight_bytes) in models.items():
            seconds, median = time_step(model, batch, kv, args.repeat)
            timings.append({"run": " ".join(label.split()), "model": name, "fastest_ms": seconds * 1e3,
                            "median_ms": median * 1e3})
            kv_read = batch.block_tables.unique().numel() * kv.spec.bytes_per_block if batch.num_decodes else 0
            print(f"  {name:>9}: {seconds * 1e3:7.1f} ms (median {median * 1e3:7.1f})  "
                  f"{tokens / seconds:6.0f} tok/s  weights {weight_bytes / seconds / 1e9:5.1f} GB/s  "
                  f"KV read {kv_read / 1e6:5.0f} MB")
            if args.breakdown and batch.num_decodes:
                parts = breakdown_step(model, batch, kv, args.repeat)
                timings[-1]["breakdown_ms"] = {part: value * 1e3 for part, value in parts.items()}
                print_breakdown(name, parts, weight_bytes, bandwidth)
            if args.profile:
                profile_step(name, model, batch, kv)
        if args.hf and batch.num_decodes:
            for name in {WEIGHTS[n][0] for n in args.dtypes}:       # transformers has no int8 of ours
                hf, hf_median = hf_decode_step(loaded.folder, getattr(torch, name), batch.num_decodes,
                                               args.ctx, args.repeat)
                print(f"  {'transformers ' + name:>20}: {hf * 1e3:7.1f} ms (median {hf_median * 1e3:7.1f})  "
                      f"{tokens / hf:6.0f} tok/s")
    if args.json:
        args.json.write_text(json.dumps({"ctx": args.ctx, "threads": args.threads, "repeat": args.repeat,
                                         "timings": timings}, indent=1))

if __name__ == "__main__":
    main()
