"""Which decodes share a prefix: `group_decodes` orders a step's decodes and picks `DecodeGroup`s.

Prefix caching makes requests with a common prompt prefix hold the same block ids for it, so the
groups come from the block tables alone; no bookkeeping elsewhere. A decode can only share blocks
that lie wholly before its own token (`(seq_len - 1) // block_size` of them): shared blocks are full
and read-only, and the one being written belongs to a single request.

Sorting the decodes by their block tables puts every set of decodes with a common prefix in one
run; neighbours' longest common prefixes (LCP, in blocks) then describe the whole tree of
prefixes. A group of k decodes sharing P blocks saves reading (k - 1) * P * block_size tokens of
KV in every layer, and costs one more attention call and merge per layer, counted here as a number
of tokens: `group_cost_tokens`, far more when the paged kernel reads the blocks in place.
`_partition` picks, within each run, either one group over the whole run (its LCP is the run's
smallest neighbour LCP) or the best groups of the sub-runs split at that smallest LCP, whichever
saves more:

    sorted tables     LCP with next
    a: [7 5 6 0]      3            block 7 (a system prompt) is shared by all five;
    b: [7 5 6 3]      1            groups {a, b} (P = 3) and {c, d, e} (P = 3) save
    c: [7 8 9 1]      3            1 * 3 + 2 * 3 = 9 blocks of reads per layer,
    d: [7 8 9 2]      3            one group {a..e} (P = 1) only 4
    e: [7 8 9 4]      -
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# What one group costs, in tokens of KV its members no longer read, when decode attention gathers
# blocks (no paged kernel: CUDA, or no compiler). `benchmarks/decode_group_cost.py` (SmolLM2's shapes,
# one layer, 1 thread, CPU time, 2-core AVX2 EPYC): a group's own pass by hand and its prefix pass
# cost ~40 us per layer more than one SDPA, and with K/V hot in cache a group pays from ~700 saved
# tokens (4 decodes x 16 shared blocks: -3 us; 16 x 8: -60 us). In a whole model step the saved
# reads come from memory and pay more: 16 decodes sharing 1,024 tokens save ~0.19 us per token
# and layer (benchmarks/model_step.py), a break-even near 200 tokens. 512 sits between the two; at worst
# a misjudged group costs ~1 ms in a step of 40 ms or more.
GROUP_COST_TOKENS = 512

# The same when the paged kernel reads every decode's blocks in place. Then a group saves no
# gather, only the kernel's passes over the prefix, which the other members find in the CPU's
# caches after the first; and it adds a gather of the prefix, `attend` and a merge. Whole bf16
# model steps, the same block tables with and without groups (benchmarks/model_step.py --shared-prefix
# with --group-cost-tokens 0 and 10**9; 2 threads, 2-core AVX-512 EPYC), us per layer that the
# group adds: 4 decodes x 256 shared tokens +268, 4 x 512 +206, 8 x 512 +196, 16 x 512 +214,
# 4 x 2,048 +104, then 8 x 2,048 -27, 16 x 1,024 -72, 32 x 512 +17, 16 x 2,048 -229, 32 x 1,024
# -248 (saving 768 ... 31,744 tokens): groups pay from ~14,000 saved tokens. In fp32 no group
# measured paid reliably (+82 to +407 us; -186 and -71 twice), so the bf16 break-even is the bar.
IN_PLACE_GROUP_COST_TOKENS = 12_288


def group_cost_tokens(in_place: bool) -> int:
    """What a group must save to be formed: the runner and the simulator's cost model ask alike."""
    return IN_PLACE_GROUP_COST_TOKENS if in_place else GROUP_COST_TOKENS


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes in rows [start, end) whose block tables share their first `prefix_blocks` ids; each
    of them has at least one key after the prefix (its own token), so the prefix is whole blocks
    that none of them writes."""

    start: int
    end: int
    prefix_blocks: int


def group_decodes(tables: Sequence[Sequence[int]], seq_lens: Sequence[int], block_size: int,
                  group_cost_tokens: int = GROUP_COST_TOKENS) -> tuple[list[int], list[DecodeGroup]]:
    """Order `len(tables)` decodes (block table and tokens in KV after this step, each) for a batch.

    Returns (order, groups): batch row r holds decode order[r]; grouped decodes come first, one
    group after another, then the others in their given order. Groups refer to batch rows."""
    assert len(tables) == len(seq_lens), "one block table per decode"
    shareable = [tuple(t[:(n - 1) // block_size]) for t, n in zip(tables, seq_lens)]
    ranked = sorted(range(len(tables)), key=shareable.__getitem__)
    lcp = [_common_prefix(shareable[a], shareable[b]) for a, b in zip(ranked, ranked[1:])]
    picked = _partition(lcp, 0, len(ranked), block_size, group_cost_tokens)[1]
    order: list[int] = []
    groups = []
    for lo, hi, prefix in picked:                   # ascending
        groups.append(DecodeGroup(len(order), len(order) + hi - lo, prefix))
        order.extend(ranked[lo:hi])
    grouped = set(order)
    order.extend(i for i in range(len(tables)) if i not in grouped)
    return order, groups


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _partition(lcp: list[int], lo: int, hi: int, block_size: int, cost: int
               ) -> tuple[int, list[tuple[int, int, int]]]:
    """Best groups of sorted decodes [lo, hi): (tokens saved net of cost, [(lo, hi, prefix blocks)])."""
    if hi - lo < 2:
        return 0, []
    shared = min(lcp[lo:hi - 1])
    cuts = [lo] + [j + 1 for j in range(lo, hi - 1) if lcp[j] == shared] + [hi]
    split_saving, split_groups = 0, []
    for a, b in zip(cuts, cuts[1:]):
        saving, groups = _partition(lcp, a, b, block_size, cost)
        split_saving += saving
        split_groups += groups
    whole = (hi - lo - 1) * shared * block_size - cost
    if shared and whole > 0 and whole >= split_saving:
        return whole, [(lo, hi, shared)]
    return split_saving, split_groups
