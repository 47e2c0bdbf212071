"""`BlockPool`: the fixed set of KV blocks of one tier, and the only code that changes their state.

Every block is in exactly one state:

    FREE       no valid content; on the free list
    CACHED     refcount 0, valid content, in the hash index, evictable in LRU order
    USED       refcount >= 1; the refcount is the number of holders (request block tables)
    IN_FLIGHT  source or target of a copy between tiers; owned by one transfer record

    allocate():        FREE -> USED                        (evicts CACHED -> FREE first if needed)
    touch() on a hit:  CACHED -> USED, USED -> USED+1
    free():            USED -> USED-1 -> CACHED (has a hash) or FREE (no hash)
    register():        a USED block that became full gets its hash and joins the index
    start_transfer():  FREE -> IN_FLIGHT;   end_transfer(): IN_FLIGHT -> USED / CACHED / FREE

Why an OrderedDict for the LRU: removing a cached block on a hit, appending a freed
one and popping the least recently used are all O(1) and run in C, which beats an
intrusive linked list written in Python. Its order is the eviction order: callers
free a request's blocks tail first, so the least reusable end of a chain goes first.

Every mutation bumps `epoch`, so a plan computed against one state can prove it is
committed against the same state. A `listener`, when set, hears every hash that joins the index
(True) or leaves it (False): that is what an engine publishes as KV events (kvstrata.engine.kv_events).
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvstrata.core.hashing import BlockHash


class BlockState(enum.Enum):
    FREE = "free"
    CACHED = "cached"
    USED = "used"
    IN_FLIGHT = "in_flight"


# Where `audit` must find a block of each state: FREE on the free list, CACHED in the LRU, the rest in neither.
_LISTED = {BlockState.FREE: "free", BlockState.CACHED: "cached"}


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    state: BlockState = BlockState.FREE
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None   # the content key, compared on every hit
    published: bool = True                     # whether the listener heard its hash (not a KV group's page: 1..)
    stale: bool = False                        # cached, and no likely hit reads it: evicted first, never offloaded


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    """A cached block that was evicted; its KV is still in place until the block is reused."""

    block_id: int
    block_hash: BlockHash
    token_ids: tuple[int, ...]
    published: bool = True
    stale: bool = False


class AuditError(AssertionError):
    """The pool's bookkeeping is inconsistent. `block_ids` names the offending blocks."""

    def __init__(self, tier: str, problem: str, block_ids: Iterable[int]):
        self.block_ids = sorted(set(block_ids))
        shown = self.block_ids[:20]
        more = f" (+{len(self.block_ids) - 20} more)" if len(self.block_ids) > 20 else ""
        super().__init__(f"{tier} tier: {problem}: blocks {shown}{more}")


@dataclass(frozen=True)
class PoolCounts:
    free: int
    cached: int
    used: int
    in_flight: int

    @property
    def total(self) -> int:
        return self.free + self.cached + self.used + self.in_flight


class BlockPool:
    """N blocks of one tier. All methods either complete or raise before changing anything."""

    def __init__(self, num_blocks: int, tier: str = "device"):
        assert num_blocks >= 1, "a pool needs at least one block"
        self.tier = tier
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[Block] = deque(self.blocks)
        self._lru: OrderedDict[int, Block] = OrderedDict()
        self._index: dict[BlockHash, Block] = {}
        self._num_used = 0
        self._num_in_flight = 0
        self.epoch = 0
        self.listener: Callable[[BlockHash, bool], None] | None = None

    # ---- queries (pure) -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    def counts(self) -> PoolCounts:
        return PoolCounts(len(self._free), len(self._lru), self._num_used, self._num_in_flight)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Block | None:
        """The block holding exactly these tokens under this hash, or None."""
        block = self._index.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def hashes(self) -> list[BlockHash]:
        """Every indexed hash (what a KV-event snapshot starts from)."""
        return list(self._index)

    def lru_order(self) -> list[int]:
        """Cached block ids, next to be evicted first."""
        return list(self._lru)

    def free_order(self) -> list[int]:
        return [block.block_id for block in self._free]

    # ---- mutations ------------------------------------------------------------------------------
    def scatter_free(self, rng: random.Random) -> None:
        """Shuffle the free list of a pool whose every block is free: a fresh pool hands out blocks in
        order, a server's after minutes of traffic lies scattered, and a decode reading scattered blocks
        took 26-32% longer (7.8-7.9 against 5.9-6.3 ms at ~1,040 tokens of context, SmolLM2, 2 threads,
        docs/design/simulator.md). Calibration and validation measure engines laid out as a server's."""
        assert len(self._free) == len(self.blocks), "only a pool with every block free is laid out again"
        order = list(self._free)
        rng.shuffle(order)
        self._free = deque(order)
        self.epoch += 1

    def allocate(self, n: int) -> tuple[list[Block], list[EvictedBlock]] | None:
        """Take n blocks as USED (refcount 1), evicting LRU cached blocks when the free list runs out.

        All or nothing: returns None, having changed nothing, if fewer than n are available.
        """
        if n > self.num_available:
            return None
        evicted = self.evict(n - len(self._free)) if n > len(self._free) else []
        blocks = [self._free.popleft() for _ in range(n)]
        for block in blocks:
            assert block.state is BlockState.FREE and block.ref_cnt == 0, f"block {block.block_id} not free"
            block.state, block.ref_cnt = BlockState.USED, 1
        self._num_used += n
        self.epoch += 1
        return blocks, evicted

    def evict(self, n: int) -> list[EvictedBlock]:
        """Move the n least recently used cached blocks to the free list (content kept until reuse)."""
        assert n <= len(self._lru), f"cannot evict {n} of {len(self._lru)} cached blocks"
        evicted = []
        for _ in range(n):
            _, block = self._lru.popitem(last=False)
            evicted.append(EvictedBlock(block.block_id, block.block_hash, block.token_ids, block.published,
                                        block.stale))
            self._forget(block)
            block.state = BlockState.FREE
            self._free.append(block)
        self.epoch += 1
        return evicted

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a holder to each block of a prefix hit (CACHED -> USED, USED -> USED+1)."""
        for block in blocks:
            if block.state is BlockState.CACHED:
                del self._lru[block.block_id]
                block.state = BlockState.USED
                self._num_used += 1
            assert block.state is BlockState.USED, f"touched block {block.block_id} is {block.state.value}"
            block.ref_cnt += 1
        self.epoch += 1

    def free(self, blocks: Iterable[Block], stale: bool = False) -> None:
        """Drop one holder from each block, in the given order (pass a table reversed: tail first). A `stale`
        block that becomes CACHED goes to the head of the LRU, next to be evicted: a page a sliding KV group let
        go that no likely hit reads (kvstrata.kvcache.growth)."""
        for block in blocks:
            assert block.state is BlockState.USED and block.ref_cnt >= 1, \
                f"double free of {self.tier} block {block.block_id} ({block.state.value})"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._num_used -= 1
                if block.block_hash is not None:
                    block.state, block.stale = BlockState.CACHED, stale
                    self._lru[block.block_id] = block
                    if stale:
                        self._lru.move_to_end(block.block_id, last=False)
                else:
                    block.state = BlockState.FREE
                    block.token_ids = None
                    self._free.append(block)
        self.epoch += 1

    def register(self, block: Block, block_hash: BlockHash, token_ids: Sequence[int], publish: bool = True) -> bool:
        """Give a full USED block its hash. Returns False (and leaves it unhashed) for a duplicate. Unless
        `publish`, the listener never hears of it (a page of a KV group other than 0: kvstrata.kvcache.kv_groups)."""
        assert block.state is BlockState.USED, f"registering {block.state.value} block {block.block_id}"
        assert block.block_hash is None or block.block_hash == block_hash, \
            f"block {block.block_id} already holds other content"
        if block.block_hash is not None or block_hash in self._index:
            return block.block_hash is not None
        block.block_hash, block.token_ids, block.published = block_hash, tuple(token_ids), publish
        self._indexed(block_hash, block)
        self.epoch += 1
        return True

    def start_transfer(self, n: int) -> tuple[list[Block], list[EvictedBlock]] | None:
        """Take n blocks as IN_FLIGHT copy targets (evicting as allocate does); None if short."""
        got = self.allocate(n)
        if got is None:
            return None
        blocks, evicted = got
        for block in blocks:
            block.state, block.ref_cnt = BlockState.IN_FLIGHT, 0
        self._num_used -= n
        self._num_in_flight += n
        return blocks, evicted

    def end_transfer(self, block: Block, outcome: BlockState, block_hash: BlockHash | None = None,
                     token_ids: Sequence[int] | None = None, publish: bool = True) -> bool:
        """Settle an IN_FLIGHT block: USED (a request takes it), CACHED (valid, nobody holds it) or FREE.

        A block with content is indexed (heard by the listener if `publish`, as `register`) unless its hash is
        already indexed, in which case it is a duplicate: it goes FREE (or stays USED unhashed). Returns whether
        it was indexed.
        """
        assert block.state is BlockState.IN_FLIGHT, f"block {block.block_id} is not in flight"
        self._num_in_flight -= 1
        self.epoch += 1
        indexed = False
        if outcome is not BlockState.FREE and block_hash is not None and block_hash not in self._index:
            block.block_hash, block.token_ids, block.published = block_hash, tuple(token_ids), publish
            self._indexed(block_hash, block)
            indexed = True
        if outcome is BlockState.USED:
            block.state, block.ref_cnt = BlockState.USED, 1
            self._num_used += 1
        elif outcome is BlockState.CACHED and indexed:
            block.state = BlockState.CACHED
            self._lru[block.block_id] = block
        else:
            block.state = BlockState.FREE
            self._free.append(block)
        return indexed

    def _indexed(self, block_hash: BlockHash, block: Block) -> None:
        self._index[block_hash] = block
        if self.listener is not None and block.published:
            self.listener(block_hash, True)

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None:
            assert self._index.get(block.block_hash) is block, f"index lost block {block.block_id}"
            del self._index[block.block_hash]
            if self.listener is not None and block.published:
                self.listener(block.block_hash, False)
        block.block_hash = block.token_ids = None
        block.published, block.stale = True, False

    # ---- audit ----------------------------------------------------------------------------------
    def snapshot(self, with_order: bool = True) -> tuple:
        """Everything observable about the pool, for before/after equality in tests.

        Without order, the free list and LRU are compared as sets: a rolled-back commit returns
        every block to its state, refcount and hash, but blocks it touched count as just used.
        """
        blocks = tuple((b.state, b.ref_cnt, b.block_hash, b.token_ids) for b in self.blocks)
        index = tuple(sorted((h, b.block_id) for h, b in self._index.items()))
        if not with_order:
            return blocks, index
        return blocks, index, tuple(self.free_order()), tuple(self.lru_order())

    def unevict(self, evicted: Sequence[EvictedBlock]) -> None:
        """Undo `evict` for blocks not reused since: back to CACHED, at the LRU head, in order."""
        for item in reversed(evicted):
            block = self.blocks[item.block_id]
            assert block.state is BlockState.FREE and item.block_hash not in self._index, \
                f"block {item.block_id} was reused after eviction"
            self._free.remove(block)
            block.state, block.block_hash, block.token_ids = BlockState.CACHED, item.block_hash, item.token_ids
            block.published, block.stale = item.published, item.stale
            self._indexed(item.block_hash, block)
            self._lru[block.block_id] = block
            self._lru.move_to_end(block.block_id, last=False)
        self.epoch += 1

    def audit(self, holders: Mapping[int, int], in_flight: Iterable[int] = ()) -> PoolCounts:
        """Prove conservation, refcounts and index consistency; raise AuditError naming bad blocks.

        `holders` maps block id -> number of request tables holding it; `in_flight` lists the blocks
        live transfer records own. Returns the per-state counts.
        """
        seen: dict[int, str] = {}
        dup: list[int] = []
        for where, ids in (("free", (b.block_id for b in self._free)), ("cached", self._lru.keys())):
            for block_id in ids:
                if block_id in seen:
                    dup.append(block_id)
                seen[block_id] = where
        if dup:
            raise AuditError(self.tier, "listed twice in the free list / LRU", dup)
        # One pass over the blocks for every per-block check (tests audit after every step)
        owned, index = set(in_flight), self._index
        wrong, bad_ref, mismatch, flight, bad_blocks = [], [], [], [], []
        used = flying = 0
        for b in self.blocks:
            block_id, state, ref = b.block_id, b.state, b.ref_cnt
            if seen.get(block_id) != _LISTED.get(state):
                wrong.append(block_id)
            if (state is BlockState.USED) != (ref >= 1) or ref < 0:
                bad_ref.append(block_id)
            if ref != holders.get(block_id, 0):
                mismatch.append(block_id)
            if (state is BlockState.IN_FLIGHT) != (block_id in owned):
                flight.append(block_id)
            if (b.block_hash is not None and index.get(b.block_hash) is not b) or \
                    (state is BlockState.CACHED and b.block_hash is None):
                bad_blocks.append(block_id)
            used += state is BlockState.USED
            flying += state is BlockState.IN_FLIGHT
        for found, what in ((wrong, "state disagrees with the free list / LRU"),
                            (bad_ref, "refcount disagrees with state"),
                            (mismatch, "refcount differs from the number of holders"),
                            (flight, "in-flight blocks and transfer records disagree")):
            if found:
                raise AuditError(self.tier, what, found)
        bad_index = [b.block_id for h, b in index.items()
                     if b.block_hash != h or b.state not in (BlockState.CACHED, BlockState.USED)] + bad_blocks
        if bad_index:
            raise AuditError(self.tier, "hash index inconsistent", bad_index)
        counts = PoolCounts(len(self._free), len(self._lru), used, flying)
        if counts != self.counts() or counts.total != self.num_blocks:
            raise AuditError(self.tier, f"counters {self.counts()} != recount {counts}", [])
        return counts
