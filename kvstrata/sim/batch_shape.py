"""Batch shapes: the counts a step's cost is charged on (the `x` of `kvstrata.sim.cost_model`).

Each term counts one kind of work the way the engine's kernels do it, so one fitted coefficient
prices it; the measurements behind each term are in docs/design/simulator.md ("The cost model").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvstrata.kvcache.prefix_groups import group_cost_tokens, group_decodes

KERNEL_TILE = 16   # keys the paged decode kernel attends at a time (W in kvstrata/model/csrc/paged_attention.cpp)

# A model's layers by the keys they attend: (window, share of the layers), None a global layer's window. A batch's
# attention terms are each kind's, weighted by its share (a coefficient prices a layer's average), so a hybrid
# model's sliding layers count their window's keys only.
LayerMix = tuple[tuple[int | None, float], ...]
GLOBAL: LayerMix = ((None, 1.0),)


def layer_mix(windows: Sequence[int | None]) -> LayerMix:
    """The mix of a model whose layers have these windows (none: every layer global)."""
    counts = Counter(windows)
    return tuple((window, count / len(windows)) for window, count in counts.items()) or GLOBAL


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
    kvstrata.model.kernels.paged) gathers only the groups' shared prefixes; each decode attends its own
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
    def of(cls, chunks: Iterable, block_size: int, in_place: bool = False, mix: LayerMix = GLOBAL) -> BatchShape:
        """The shape of a step's `ScheduledChunk`s; `in_place`: decodes read their blocks in place; `mix`: the
        model's layers by window (its sliding layers' terms are their windows')."""
        if mix == GLOBAL:
            return cls._of(chunks, block_size, in_place, None)
        chunks = list(chunks)
        shapes = [(share, cls._of(chunks, block_size, in_place, window)) for window, share in mix]
        return cls(*(sum(share * shape[i] for share, shape in shapes) for i in range(len(cls._fields))))

    @classmethod
    def _of(cls, chunks: Iterable, block_size: int, in_place: bool, window: int | None) -> BatchShape:
        """The shape as layers of `window` (None: global) do the work: a sliding layer's rows read from their
        window's first key (in place: its 16-key tile; gathered: its block) and a fresh chunk longer than the
        window is masked, not causal."""
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
                fresh += kernel_pairs(start, n, window)
                kv += -(-(start + n) // KERNEL_TILE) * KERNEL_TILE - _window_start(start + 1, window, KERNEL_TILE)
            elif start == 0 and (window is None or n <= window):
                fresh += causal_pairs(n)
            elif start == 0:                          # its own keys under a mask: every pair computed
                masked += n * n
            else:
                keys = -(-(start + n) // block_size) * block_size - _window_start(start + 1, window, block_size)
                kv += keys
                masked += n * keys
        work = _decode_work(decodes, block_size, in_place, window)
        return cls(prefill, len(decodes), kv + work.reads, fresh, masked, count, work.groups, work.pairs,
                   work.segments, work.lone_pairs, work.prefix_pairs)

    @classmethod
    def alone(cls, start: int, n: int, block_size: int, in_place: bool = False, mix: LayerMix = GLOBAL) -> BatchShape:
        """The shape of a step that runs one chunk of n tokens from position `start` and nothing else."""
        return cls.of([_Chunk(start, range(n), ())], block_size, in_place, mix)

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


def kernel_pairs(start: int, n: int, window: int | None = None) -> int:
    """Query-key pairs the paged kernel computes for a chunk of n positions after `start` others:
    position i attends the 16-key tiles up to its own key, start + i + 1 keys rounded up (with a window, from
    the tile of its window's first key, start + i + 1 - window, on)."""
    def upto(keys: int) -> int:                       # sum over k = 1 .. keys of k rounded up to a tile
        tiles, rest = divmod(keys, KERNEL_TILE)
        return KERNEL_TILE * (KERNEL_TILE * tiles * (tiles + 1) // 2 + rest * (tiles + 1))

    def below(keys: int) -> int:                      # sum over k = 0 .. keys - 1 of k rounded down to a tile
        tiles, rest = divmod(max(0, keys), KERNEL_TILE)
        return KERNEL_TILE * (KERNEL_TILE * tiles * (tiles - 1) // 2 + rest * tiles)
    pairs = upto(start + n) - upto(start)
    if window is None:
        return pairs
    return pairs - (below(start + n + 1 - window) - below(start + 1 - window))


def _window_start(keys: int, window: int | None, unit: int) -> int:
    """The first key read for a query that sees `keys` keys (or their last `window`), rounded down to `unit`."""
    return 0 if window is None else max(0, keys - window) // unit * unit


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


def _decode_work(decodes: Sequence, block_size: int, in_place: bool, window: int | None = None) -> _DecodeWork:
    """What the decodes cost as the runner forms them: KV tokens gathered (each segment padded to
    its longest member, shared prefixes once; in place: the prefixes only), cascade groups,
    query-key pairs attended (each prefix once per member) and batched attention segments."""
    if not decodes:
        return _DecodeWork(0, 0, 0, 0, 0, 0)
    seq_lens = [d.start + 1 for d in decodes]
    if window is not None:
        return _sliding_decodes(seq_lens, block_size, in_place, window)
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


def _sliding_decodes(seq_lens: list[int], block_size: int, in_place: bool, window: int) -> _DecodeWork:
    """A sliding layer's decodes: none shares a prefix (a group's may lie outside a window); in place each reads from
    its window's first 16-key tile, gathered all of them read every block under a mask, in one padded segment."""
    if in_place:
        keys = [-(-n // KERNEL_TILE) * KERNEL_TILE - _window_start(n, window, KERNEL_TILE) for n in seq_lens]
    else:
        keys = [-(-n // block_size) * block_size for n in seq_lens]
    pairs = sum(keys) if in_place else len(keys) * max(keys)
    return _DecodeWork(0 if in_place else pairs, 0, pairs, 1, pairs if len(keys) == 1 else 0, 0)
