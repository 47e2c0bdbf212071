"""A prefix hit under KV groups: the longest hit every group serves, each page from whichever tier holds it.

Group 0's blocks chain device -> host -> store as without groups (`Admission._hits`). A hit of L blocks also
needs every other global group's pages of [0, L) and a sliding group's from the window of the first token
computed after it (`KVGroups.first_needed`); the pages before may be gone from every tier. Each of those pages
may come from the device (a hit), the host (a copy) or the store (a load), in any mix: a sliding page left its
window on the device and was evicted to the host long before the global pages of the same block were. The
matcher takes the longest L, from group 0's down, that every group serves, looking each page up once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.core.hashing import BlockHash
from kvstrata.core.request import Request
from kvstrata.kvcache.block_pool import Block, BlockPool
from kvstrata.kvcache.kv_groups import KVGroups, group_hash
from kvstrata.kvcache.store_io import StoreIO

Source = tuple[str, Block | BlockHash]          # ("device" | "host", the page) or ("store", its key)


@dataclass
class GroupHit:
    """Groups 1..'s part of a hit of `length` blocks: their tables' device pages (None where the group needs no
    page, or loads it), and the pages they load as (group, block index, host page) and (group, block index, key)."""

    length: int
    tables: list[list[Block | None]]
    host: list[tuple[int, int, Block]] = field(default_factory=list)
    store: list[tuple[int, int, BlockHash]] = field(default_factory=list)
    windowed: bool = False          # a sliding group served it with its window alone (the pages before not needed)


class GroupMatcher:
    """Finds, for a request and group 0's hit, the longest part every other group serves."""

    def __init__(self, groups: KVGroups, block_size: int, device: BlockPool, host: BlockPool | None,
                 store_io: StoreIO | None):
        self.groups = groups
        self.block_size = block_size
        self.device = device
        self.host = host
        self.store_io = store_io

    def lookup_keys(self, request: Request, start: int, num_blocks: int) -> list[BlockHash]:
        """The keys one store lookup asks for every group, where group 0's device and host run ends at block
        `start`: group 0's blocks from `start` to `num_blocks`, a sliding group's pages from the window of a hit
        of `start` blocks on, another global group's pages the device and host lack. So a hit of `start` blocks
        or more sees the store's every page it needs; a shorter one (some group short of its part at `start`)
        finds the store's pages only where they were asked (or written by this engine since)."""
        hashes, size = request.block_hashes, self.block_size
        keys = list(hashes[start:num_blocks])
        for group in range(1, self.groups.num_groups):
            first = self.groups.first_needed(group, start * size, size)
            sliding = self.groups.windows[group] is not None
            keys += [group_hash(hashes[index], group) for index in range(first, num_blocks)
                     if sliding or self._find(request, group, index, host=True, store=False) is None]
        return keys

    def match(self, request: Request, num_blocks: int, host: bool, store: bool) -> GroupHit:
        """The longest hit of at most `num_blocks` blocks (group 0's) every other group serves, from the device
        and, as asked, the host and the store."""
        size, groups = self.block_size, self.groups
        found: dict[tuple[int, int], Source | None] = {}

        def page(group: int, index: int) -> Source | None:
            if (group, index) not in found:
                found[group, index] = self._find(request, group, index, host, store)
            return found[group, index]

        others = range(1, groups.num_groups)
        longest = num_blocks
        for group in others:                       # a global group serves a leading run of pages
            if groups.windows[group] is None:
                longest = next((index for index in range(longest) if page(group, index) is None), longest)
        for length in range(longest, -1, -1):
            firsts = [groups.first_needed(group, length * size, size) for group in others]
            if all(page(group, index) is not None for group, first in zip(others, firsts)
                   for index in range(first, length)):
                return self._hit(length, firsts, found)
        raise AssertionError("a hit of no block is always served")

    def _find(self, request: Request, group: int, index: int, host: bool, store: bool) -> Source | None:
        """Where group `group`'s page of block `index` is: the device first, then the host, then the store."""
        size = self.block_size
        key = group_hash(request.block_hashes[index], group)
        tokens = request.token_ids[index * size:(index + 1) * size]
        block = self.device.lookup(key, tokens)
        if block is not None:
            return "device", block
        block = self.host.lookup(key, tokens) if host and self.host is not None else None
        if block is not None:
            return "host", block
        if store and self.store_io is not None and self.store_io.holds(request.request_id, key):
            return "store", key
        return None

    def _hit(self, length: int, firsts: list[int], found: dict[tuple[int, int], Source | None]) -> GroupHit:
        hit = GroupHit(length, [], windowed=length > 0 and any(firsts))
        for group, first in enumerate(firsts, 1):
            table: list[Block | None] = [None] * length
            for index in range(first, length):
                tier, source = found[group, index]
                if tier == "device":
                    table[index] = source
                elif tier == "host":
                    hit.host.append((group, index, source))
                else:
                    hit.store.append((group, index, source))
            hit.tables.append(table)
        return hit
