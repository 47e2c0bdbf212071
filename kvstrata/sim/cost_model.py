"""Step time and transfer time: what the simulator charges for a batch and for moving KV.

    step_seconds = overhead_s + max(compute . x, memory . x)
    x = (1, prefill_tokens, decode_seqs, kv_tokens_read, attention_pairs, masked_pairs, prefill_chunks,
         decode_groups, decode_pairs, decode_segments, lone_decode_pairs, prefix_pairs)   (BatchShape)

Two sources of coefficients, and every profile says which in `source`:
- *calibrated*: a non-negative least-squares fit of the real engine's step times over a grid of
  batch shapes on this machine (`kvstrata calibrate`); all terms in `compute`, `memory` empty.
- *roofline*: derived from a hardware description (peak FLOP/s, memory bandwidth, links) and the
  model's size, for machines we cannot run. Compute: 2 FLOPs per parameter per token plus attention
  FLOPs per query-key pair, at `flops_efficiency` of peak; memory: the weights once per step plus
  the KV of every context read, at `bandwidth_efficiency` of peak; a step costs the slower of the two.

Moving KV costs `latency + bytes / bandwidth` on a `Link`: device <-> host copies on `host_link`,
store I/O on `store_link`; a block's bytes come from `kv_bytes_per_token`. Encoding a block's store
record (before a write) and decoding one (after a load) run in the engine's step loop and cost
`record_link` and `decode_link` each (checksums and copies; None: free, as in profiles made before
they were measured; a profile without `decode_link` decodes at `record_link`).

A calibrated profile names what it was fitted on (`fitted_on`: the batch grid, and any trace slices
replayed), so a validation can refuse to call a slice it was fitted on a validation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvstrata.core.machine import machine as current_machine
from kvstrata.kvcache.prefix_groups import group_cost_tokens, group_decodes

logger = logging.getLogger(__name__)

KERNEL_TILE = 16   # keys the paged decode kernel attends at a time (W in kvstrata/model/csrc/paged_attention.cpp)
FEATURES = ("step", "prefill_tokens", "decode_seqs", "kv_tokens_read", "attention_pairs", "masked_pairs",
            "prefill_chunks", "decode_groups", "decode_pairs", "decode_segments", "lone_decode_pairs",
            "prefix_pairs")


class BatchShape(NamedTuple):
    """What a step computes, counted the way the runner and `PagedAttention` do the work.

    A chunk of one token is a decode (the runner batches it as one). The attention paths differ
    in cost per pair, so they are separate features:
    - a chunk that starts its sequence runs causal SDPA on its own K/V, no gather: the pairs the
      kernel computes (`causal_pairs`: whole key tiles up to the diagonal, n^2 up to 512 tokens);
    - a chunk after cached or computed tokens gathers its sequence's blocks and runs masked SDPA over
      all of them: n x (its blocks x block size) pairs, every one computed, and those keys read;
    - decodes read their blocks in segments padded to the longest member, and a group of decodes
      sharing prefix blocks (cascade attention, `group_decodes`) reads that prefix once, at a
      fixed cost per group (its attention is written out, not one SDPA, plus a merge, every layer).
    Decode attention is its own work beside the gather: one query row per decode against every key
    of its segment (padded; `decode_pairs`) and of its group's prefix (`prefix_pairs`: a shared
    prefix is read once but attended by each member, in one matmul per group, cheaper per pair
    than a decode's own keys), in one batched call per segment and layer (`decode_segments`: a
    decode step pays that fixed cost, a step of prefills alone does not). These terms barely move
    a CPU's fit, where decode attention is cheap beside the gather, but keep it right where it is not.
    A decode alone in its segment (one query row in the call: a batch of one, or the one decode
    left out of every group) attends each key at a higher price than a batched row does
    (`lone_decode_pairs`). A request decoding alone is what TPOT at light load measures.
    The measurements behind these terms: docs/design/simulator.md ("The cost model").
    Every prefill chunk also costs a fixed amount (its own SDPA call and plan in every layer).
    An engine whose decodes read their blocks in place (`in_place`: the paged kernel,
    kvstrata.model.kernels) gathers only the groups' shared prefixes; each decode attends its own
    keys unpadded (16-key tiles from its group's prefix on), all decodes in one call per layer
    (one segment), and a lone decode is a step with a single decode (its kv heads are the only
    work items the threads share). Its prefill chunks, fresh or not, go through the kernel too
    (`kernel_pairs`): each position attends the 16-key tiles up to its own, no mask, no padding
    to blocks, so they count as `attention_pairs`, and each chunk reads its keys once (its tiles,
    made ready for many rows) into `kv_tokens_read`.
    """

    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_tokens_read: int = 0       # KV tokens gathered: decode segments (padded) and their shared
                                  # prefixes, and the blocks of each chunk that continues a sequence
                                  # (in place: every chunk's keys, to its last 16-key tile)
    attention_pairs: int = 0      # query-key pairs computed for chunks that start a sequence (causal_pairs);
                                  # in place: for every chunk (kernel_pairs)
    masked_pairs: int = 0         # query-key pairs of chunks that continue one (masked, padded to blocks)
    prefill_chunks: int = 0
    decode_groups: int = 0        # cascade groups of decodes sharing a prefix
    decode_pairs: int = 0         # query-key pairs of decodes' own keys: padded segments (in place: 16-key tiles)
    decode_segments: int = 0      # batched decode attention calls per layer: grouped decodes, the others
    lone_decode_pairs: int = 0    # of decode_pairs, those of a segment of one decode
    prefix_pairs: int = 0         # query-key pairs of groups' shared prefixes, once per member

    @classmethod
    def of(cls, chunks: Iterable, block_size: int, in_place: bool = False) -> BatchShape:
        """The shape of a step's `ScheduledChunk`s; `in_place`: decodes read their blocks in place."""
        prefill = kv = fresh = masked = count = 0
        decodes = []
        for chunk in chunks:
            n, start = len(chunk.token_ids), chunk.start
            if n == 1:
                decodes.append(chunk)
                continue
            prefill += n
            count += 1
            if in_place:
                fresh += kernel_pairs(start, n)
                kv += -(-(start + n) // KERNEL_TILE) * KERNEL_TILE
            elif start == 0:
                fresh += causal_pairs(n)
            else:
                keys = -(-(start + n) // block_size) * block_size
                kv += keys
                masked += n * keys
        work = _decode_work(decodes, block_size, in_place)
        return cls(prefill, len(decodes), kv + work.reads, fresh, masked, count, work.groups, work.pairs,
                   work.segments, work.lone_pairs, work.prefix_pairs)

    @classmethod
    def alone(cls, start: int, n: int, block_size: int, in_place: bool = False) -> BatchShape:
        """The shape of a step that runs one chunk of n tokens from position `start` and nothing else."""
        return cls.of([_Chunk(start, range(n), ())], block_size, in_place)

    def features(self) -> tuple[float, ...]:
        return (1.0, *self)


# torch's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), which the runner's
# causal SDPA of a chunk that starts its sequence runs: keys in tiles of 512, queries in tiles of 32,
# 64 or 256 by the chunk's length
KEY_TILE = 512
QUERY_TILES = ((768, 256), (192, 64), (0, 32))       # (from this many query rows, the tile)


def causal_pairs(n: int) -> int:
    """Query-key pairs the causal kernel computes for a chunk of n tokens attending to itself.

    It skips only whole key tiles past a query tile's last row, and masks inside the tiles it
    computes, so up to 512 tokens it computes all n^2 pairs, not the n (n + 1) / 2 that count;
    beyond, a query tile computes every key tile it reaches. Counted so, a causal pair costs what a
    masked one does (the same kernel per pair); counted as n (n + 1) / 2, fresh chunks misfit
    (docs/design/simulator.md, "The cost model").
    """
    tile = next(size for rows, size in QUERY_TILES if n >= rows)
    keys = min(KEY_TILE, n)
    return sum(min(tile, n - first) * min(-(-min(first + tile, n) // keys) * keys, n)
               for first in range(0, n, tile))


def kernel_pairs(start: int, n: int) -> int:
    """Query-key pairs the paged kernel computes for a chunk of n positions after `start` others:
    position i attends the 16-key tiles up to its own key, start + i + 1 keys rounded up."""
    def upto(keys: int) -> int:                       # sum over k = 1 .. keys of k rounded up to a tile
        tiles, rest = divmod(keys, KERNEL_TILE)
        return KERNEL_TILE * (KERNEL_TILE * tiles * (tiles + 1) // 2 + rest * (tiles + 1))
    return upto(start + n) - upto(start)


class _Chunk(NamedTuple):
    """What BatchShape.of reads of a `ScheduledChunk`."""

    start: int
    token_ids: Sequence[int]
    block_ids: Sequence[int]


class _DecodeWork(NamedTuple):
    reads: int          # KV tokens gathered
    groups: int
    pairs: int          # of decodes' own keys
    segments: int
    lone_pairs: int     # pairs of segments of one decode
    prefix_pairs: int   # of groups' shared prefixes, per member


def _decode_work(decodes: Sequence, block_size: int, in_place: bool) -> _DecodeWork:
    """What the decodes cost as the runner forms them: KV tokens gathered (each segment padded to
    its longest member, shared prefixes once; in place: the prefixes only), cascade groups,
    query-key pairs attended (each prefix once per member) and batched attention segments."""
    if not decodes:
        return _DecodeWork(0, 0, 0, 0, 0, 0)
    seq_lens = [d.start + 1 for d in decodes]
    blocks = [-(-n // block_size) for n in seq_lens]
    if len(decodes) < 2:
        keys = -(-seq_lens[0] // KERNEL_TILE) * KERNEL_TILE if in_place else blocks[0] * block_size
        return _DecodeWork(0 if in_place else keys, 0, keys, 1, keys, 0)
    order, groups = group_decodes([d.block_ids for d in decodes], seq_lens, block_size, group_cost_tokens(in_place))
    grouped = groups[-1].end if groups else 0
    own = [blocks[i] for i in order]             # blocks each row reads itself, in batch order
    first = [0] * len(decodes)                   # each row's first key after its group's prefix
    shared = shared_pairs = 0
    for group in groups:
        shared += group.prefix_blocks
        shared_pairs += (group.end - group.start) * group.prefix_blocks
        for row in range(group.start, group.end):
            own[row] -= group.prefix_blocks
            first[row] = group.prefix_blocks * block_size
    if in_place:
        tiles = sum(-(-seq_lens[i] // KERNEL_TILE) - f // KERNEL_TILE for i, f in zip(order, first))
        return _DecodeWork(shared * block_size, len(groups), tiles * KERNEL_TILE, 1, 0, shared_pairs * block_size)
    segments = [(start, end) for start, end in ((0, grouped), (grouped, len(decodes))) if end > start]
    padded = sum((end - start) * max(own[start:end]) for start, end in segments)
    lone = sum(own[start] for start, end in segments if end - start == 1)
    return _DecodeWork((padded + shared) * block_size, len(groups), padded * block_size, len(segments),
                       lone * block_size, shared_pairs * block_size)


@dataclass(frozen=True)
class Link:
    """A path KV travels: a fixed latency per operation, then bytes at a bandwidth."""

    latency_s: float
    bandwidth: float              # bytes per second

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class CostModel:
    source: str                                  # how the numbers were obtained, for every report
    kv_bytes_per_token: int
    host_link: Link
    store_link: Link
    compute: tuple[float, ...]                   # seconds per unit of each of FEATURES
    memory: tuple[float, ...] = (0.0,) * len(FEATURES)
    overhead_s: float = 0.0
    device_cache_tokens: int | None = None       # what the device holds beside the weights, when known
    record_link: Link | None = None              # encode one block's store record, in the step
    decode_link: Link | None = None              # decode one (None: as record_link): it checks and copies
                                                 # more than an encode (docs/design/simulator.md)
    fitted_on: tuple[dict, ...] = ()             # what a calibrated profile was fitted to (see calibrate)
    decode_in_place: bool = False                # the engine fitted on read blocks in place (decodes, prefill chunks)
    machine: dict | None = None                  # a calibrated profile's CPU (kvstrata.core.machine) and engine dtype

    def __post_init__(self) -> None:
        if len(self.compute) != len(FEATURES) or len(self.memory) != len(FEATURES):
            raise ValueError(f"a cost model has one coefficient per feature: {', '.join(FEATURES)}")
        if min(self.compute + self.memory) < 0:
            raise ValueError("cost model coefficients must not be negative")

    def step_seconds(self, shape: BatchShape) -> float:
        """Unrolled: the simulator asks once per step, millions of times per trace."""
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11 = self.compute
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11 = self.memory
        p, d, kv, pairs, masked, chunks, groups, dpairs, segments, lone, prefix = shape
        return self.overhead_s + max(
            c0 + c1 * p + c2 * d + c3 * kv + c4 * pairs + c5 * masked + c6 * chunks + c7 * groups + c8 * dpairs
            + c9 * segments + c10 * lone + c11 * prefix,
            m0 + m1 * p + m2 * d + m3 * kv + m4 * pairs + m5 * masked + m6 * chunks + m7 * groups + m8 * dpairs
            + m9 * segments + m10 * lone + m11 * prefix)

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def record_seconds(self, block_size: int, decode: bool = False) -> float:
        """Engine-thread time to encode (or decode) one block's store record."""
        link = self.decode_link if decode and self.decode_link is not None else self.record_link
        return 0.0 if link is None else link.seconds(self.block_bytes(block_size))

    # ---- files ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = asdict(self)
        data["compute"] = dict(zip(FEATURES, self.compute))
        data["memory"] = dict(zip(FEATURES, self.memory))
        data["fitted_on"] = list(self.fitted_on)
        return data

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        unknown = set(data.get("compute", {})) | set(data.get("memory", {}))
        if unknown - set(FEATURES):
            raise ValueError(f"unknown cost model features: {', '.join(sorted(unknown - set(FEATURES)))}")
        return cls(source=data["source"], kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                   host_link=Link(**data["host_link"]), store_link=Link(**data["store_link"]),
                   compute=tuple(float(data["compute"].get(f, 0.0)) for f in FEATURES),
                   memory=tuple(float(data.get("memory", {}).get(f, 0.0)) for f in FEATURES),
                   overhead_s=float(data.get("overhead_s", 0.0)),
                   device_cache_tokens=data.get("device_cache_tokens"),
                   record_link=Link(**data["record_link"]) if data.get("record_link") else None,
                   decode_link=Link(**data["decode_link"]) if data.get("decode_link") else None,
                   fitted_on=tuple(data.get("fitted_on", ())),
                   decode_in_place=bool(data.get("decode_in_place", False)), machine=data.get("machine"))

    def other_machine(self) -> str | None:
        """Why this calibrated profile does not time steps on this machine, or None where it does
        (roofline profiles describe hardware by name and are never checked)."""
        if self.source.startswith("roofline"):
            return None
        here = current_machine()
        if self.machine is None:
            return (f"this profile does not say which CPU it was calibrated on ({self.source}); this machine is "
                    f"{here.kind}")
        if self.machine.get("kind") != here.kind:
            return (f"this profile was calibrated on {self.machine.get('kind')} in {self.machine.get('dtype')}; "
                    f"this machine is {here.kind}: its step times do not apply here")
        return None

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read a cost profile from {path}: {exc!r}") from exc


# ---- calibration: fitting measured steps --------------------------------------------------------
def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative term and refit until none is.

    Enough for a handful of physically non-negative terms (a full NNLS solver is not worth a dependency).
    """
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        fit = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if fit.min() >= 0:
            coef[active] = fit
            break
        del active[int(np.argmin(fit))]
    return coef


def fit(shapes: Sequence[BatchShape], seconds: Sequence[float], **profile) -> CostModel:
    """Fit `compute` to measured step times, minimizing relative error (steps span 1 ms to seconds)."""
    if len(shapes) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps to fit a cost model")
    x = np.array([s.features() for s in shapes], dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    coef = nonnegative_lstsq(x / scale / y[:, None], np.ones_like(y)) / scale
    return CostModel(compute=tuple(float(c) for c in coef), **profile)


def relative_errors(model: CostModel, shapes: Sequence[BatchShape], seconds: Sequence[float]) -> np.ndarray:
    predicted = np.array([model.step_seconds(s) for s in shapes])
    return predicted / np.asarray(seconds) - 1.0


# ---- roofline: hardware we cannot run -----------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    description: str
    peak_flops: float                # dense 16-bit FLOP/s (fp32 for the CPU)
    memory_bandwidth: float          # bytes per second
    memory_bytes: int
    host_link: Link                  # device <-> host memory
    store_link: Link                 # engine -> store
    flops_efficiency: float = 0.5    # the share of peak a serving engine reaches on large GEMMs
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.002   # scheduling, launches and sampling per step


@dataclass(frozen=True)
class ModelSpec:
    description: str
    params: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> float:
        """Q.K and P.V for one query-key pair, every head of every layer."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("NVIDIA H100 SXM 80GB: 989 TFLOP/s bf16, 3.35 TB/s HBM3, PCIe 5 x16 to host, "
                     "200 Gb/s to the store", 989e12, 3.35e12, 80 * 10**9,
                     host_link=Link(10e-6, 50e9), store_link=Link(100e-6, 25e9)),
    "a100": Hardware("NVIDIA A100 SXM 80GB: 312 TFLOP/s bf16, 2.04 TB/s HBM2e, PCIe 4 x16 to host, "
                     "100 Gb/s to the store", 312e12, 2.039e12, 80 * 10**9,
                     host_link=Link(10e-6, 25e9), store_link=Link(100e-6, 12.5e9)),
    "l4": Hardware("NVIDIA L4 24GB: 121 TFLOP/s bf16, 300 GB/s GDDR6, PCIe 4 x16 to host, 25 Gb/s to the store",
                   121e12, 300e9, 24 * 10**9, host_link=Link(10e-6, 25e9), store_link=Link(200e-6, 3.1e9)),
    "cpu-2core": Hardware("2 x86 cores with AVX2 (~100 GFLOP/s fp32), ~20 GB/s DRAM; host tier is a memcpy, "
                          "the store a local SSD", 100e9, 20e9, 16 * 10**9,
                          host_link=Link(2e-6, 10e9), store_link=Link(100e-6, 1e9),
                          flops_efficiency=0.3, bandwidth_efficiency=0.5, step_overhead_s=0.001),
}

MODELS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec("Llama-3-8B (GQA 32/8 heads, 32 layers), bf16", 8.03e9, 32, 32, 8, 128),
    "smollm2-135m": ModelSpec("SmolLM2-135M (GQA 9/3 heads, 30 layers), bf16", 134.5e6, 30, 9, 3, 64),
}


def roofline(hardware: str, model: str) -> CostModel:
    """A profile from first principles, for hardware this machine is not."""
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(HARDWARE)}")
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    hw, spec = HARDWARE[hardware], MODELS[model]
    flops = hw.peak_flops * hw.flops_efficiency
    bandwidth = hw.memory_bandwidth * hw.bandwidth_efficiency
    per_token = 2 * spec.params / flops
    pair = spec.attention_flops_per_pair / flops
    compute = (0.0, per_token, per_token, 0.0, pair, pair, 0.0, 0.0, pair, 0.0, 0.0, pair)
    memory = (spec.weight_bytes / bandwidth, 0.0, 0.0, spec.kv_bytes_per_token / bandwidth, 0.0, 0.0, 0.0, 0.0,
              0.0, 0.0, 0.0, 0.0)
    kv_memory = hw.memory_bytes * 0.9 - spec.weight_bytes
    if kv_memory <= 0:
        raise ValueError(f"{model} does not fit in the memory of {hardware}")
    return CostModel(
        source=(f"roofline: {hardware} ({hw.description}; {hw.flops_efficiency:.0%} of peak FLOP/s, "
                f"{hw.bandwidth_efficiency:.0%} of peak bandwidth) x {model} ({spec.description})"),
        kv_bytes_per_token=spec.kv_bytes_per_token, host_link=hw.host_link, store_link=hw.store_link,
        compute=compute, memory=memory, overhead_s=hw.step_overhead_s,
        device_cache_tokens=int(kv_memory // spec.kv_bytes_per_token))
