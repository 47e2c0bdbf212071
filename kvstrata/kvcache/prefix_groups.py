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
# blocks (no paged kernel: CUDA, or no compiler): between the break-even of one layer with K/V hot in
# cache (~700 tokens, `benchmarks/decode_group_cost.py`) and that of a whole model step reading from
# memory (~200, `benchmarks/model_step.py`); a misjudged group costs little either way. The
# measurements: docs/design/model.md, "Decode groups".
GROUP_COST_TOKENS = 512

# The same when the paged kernel reads every decode's blocks in place. Then a group saves no
# gather, only the kernel's passes over the prefix, which the other members find in the CPU's
# caches after the first; and it adds a gather of the prefix, `attend` and a merge. In whole bf16
# model steps with and without groups (`benchmarks/model_step.py --shared-prefix`), groups paid
# from ~14,000 saved tokens (16 decodes sharing 1,024 tokens qualify, 4 sharing 512 do not); in
# fp32 none paid reliably, so the bf16 break-even is the bar. The measurements: docs/design/model.md.
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
