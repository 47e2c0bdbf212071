"""KV cache groups: which layers share a page, and how much of a sequence each group keeps on the device.

A hybrid model (Gemma 3: 5 of every 6 layers see only their last W tokens) keeps, at 8,000 tokens, every
global layer's 8,000 keys but only ~W of each sliding layer's. So layers are grouped by attention kind into
groups of g layers, g the greatest common divisor of the kinds' layer counts (Gemma 3 270M: 3 global + 15
sliding layers, g = 3: one global group and five sliding ones), and a page holds one group's g layers for one
block of tokens. Every page has the same bytes, so one pool with one free list serves every group, and memory
moves between global and sliding pages as the traffic's context lengths move (docs/design/model.md, "KV cache
groups"). A request holds one block table per group; a sliding group's entries before its window are
released, and its pages are keyed apart from the other groups' (`group_hash`).

Group 0 is always global. A model whose layers are all of one kind has one group of every layer, today's
layout (a model whose every layer slides keeps full-length KV: nothing else to group them with).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvstrata.core.hashing import BlockHash


@dataclass(frozen=True)
class KVGroup:
    """Layers whose K/V share a page, and their sliding window (None: the group keeps every key)."""

    layers: tuple[int, ...]
    window: int | None


@dataclass(frozen=True)
class KVGroups:
    """Every layer in exactly one group of `layers_per_page` layers; group 0 global."""

    groups: tuple[KVGroup, ...]

    def __post_init__(self) -> None:
        layers = sorted(layer for group in self.groups for layer in group.layers)
        assert layers == list(range(len(layers))), f"every layer in exactly one group, not {layers}"
        assert len({len(group.layers) for group in self.groups}) == 1, "groups of equal size"
        assert self.groups[0].window is None, "group 0 is a global group"

    @classmethod
    def for_windows(cls, windows: Sequence[int | None]) -> KVGroups:
        """Groups for layers of these windows (None: global): g = gcd of the kinds' counts, global first."""
        global_layers = tuple(i for i, w in enumerate(windows) if w is None)
        sliding = tuple(i for i, w in enumerate(windows) if w is not None)
        if not global_layers or not sliding:
            return cls((KVGroup(tuple(range(len(windows))), None),))
        g = math.gcd(len(global_layers), len(sliding))
        window = windows[sliding[0]]
        return cls(tuple(KVGroup(global_layers[i:i + g], None) for i in range(0, len(global_layers), g))
                   + tuple(KVGroup(sliding[i:i + g], window) for i in range(0, len(sliding), g)))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_page(self) -> int:
        return len(self.groups[0].layers)

    @property
    def num_layers(self) -> int:
        return self.num_groups * self.layers_per_page

    @functools.cached_property
    def page_slot(self) -> tuple[int, ...]:
        """Each layer's place within its group's pages."""
        slots = [0] * self.num_layers
        for group in self.groups:
            for slot, layer in enumerate(group.layers):
                slots[layer] = slot
        return tuple(slots)

    @functools.cached_property
    def group_of(self) -> tuple[int, ...]:
        """Each layer's group."""
        of = [0] * self.num_layers
        for index, group in enumerate(self.groups):
            for layer in group.layers:
                of[layer] = index
        return tuple(of)

    @functools.cached_property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    def first_needed(self, group: int, position: int, block_size: int) -> int:
        """The first block group `group` reads for a query at `position` (and any later one): the block of
        its window's first key (transformers' edge: a query sees W keys, itself included), 0 for a global group."""
        window = self.groups[group].window
        return 0 if window is None else max(0, position - window + 1) // block_size

    def peak_blocks(self, group: int, num_blocks: int, num_tokens: int, block_size: int) -> int:
        """Most blocks the group holds of a sequence of `num_blocks` blocks while computing `num_tokens` at once
        (a chunk, or a decode and its drafts): every block for a global group, the window's and the chunk's for
        a sliding one."""
        window = self.groups[group].window
        if window is None:
            return num_blocks
        return min(num_blocks, (max(1, num_tokens) + window - 2) // block_size + 2)


def group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The key of a block's page in `group`: group 0's is the block's own hash (what the router, KV events and
    other engines know), another group's derives from it, so no group can hit another group's page."""
    if group == 0:
        return block_hash
    return xxhash.xxh3_128_digest(block_hash + b"kv-group" + group.to_bytes(2, "little"))


def kv_groups_for(windows: Sequence[int | None], *, swa_full: bool) -> KVGroups:
    """The grouping an engine runs: by kind for a hybrid model, unless `--swa-full` keeps every layer at full
    length."""
    if swa_full:
        return KVGroups.for_windows([None] * len(windows))
    return KVGroups.for_windows(windows)


def cache_fingerprint(model_fingerprint: str, groups: KVGroups) -> str:
    """What keys the cache of a model run with `groups`: a page of grouped layers holds other K/V than a block of
    every layer under the same hash, so an engine with groups and one at full length (`--swa-full`) sharing a
    store never read each other's records (one group: the model's fingerprint, as before groups)."""
    if groups.num_groups == 1:
        return model_fingerprint
    layout = [list(group.layers) for group in groups.groups], list(groups.windows)
    return hashlib.sha256(f"{model_fingerprint}:kv-groups:{layout}".encode()).hexdigest()
