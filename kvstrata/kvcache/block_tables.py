"""Who holds which device blocks: each request's block table, the samples waiting to fork, the tables
whose request waits on a store load, and the hashes of the full blocks being computed.

Bookkeeping only: nothing here calls a pool. The parts that take and give back blocks (admission,
growth, loads) record here what they did, and the audit checks every pool against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.core.hashing import BlockHash
from kvstrata.core.request import Request
from kvstrata.kvcache.block_pool import Block
from kvstrata.kvcache.transfers import LoadTransfer


@dataclass
class RequestBlocks:
    """A request's device block table, how many of its blocks are indexed, and its pending load.

    `block_ids` mirrors `blocks` as plain ints, kept in step, so handing the table to the runner
    every step costs nothing. Blocks [num_registered, num_announced) are full blocks of known
    tokens that the request is computing or loading: their hashes are in `BlockTables.computing`.
    Inside a speculative step the last blocks may hold slots for `num_draft_tokens` draft tokens,
    which are never announced (a draft has no hash) and are given back once verified.

    With KV groups (kvstrata.kvcache.kv_groups) `blocks` is group 0's table and `extra[k - 1]` group k's, as
    long, with None (id -1) where a sliding group released a page its window no longer reads.
    """

    request: Request
    blocks: list[Block]
    num_registered: int = 0
    load: LoadTransfer | None = None
    num_draft_tokens: int = 0
    extra: list[list[Block | None]] = field(default_factory=list)
    block_ids: list[int] = field(init=False)
    extra_ids: list[list[int]] = field(init=False)
    num_announced: int = field(init=False)

    def __post_init__(self) -> None:
        self.block_ids = [block.block_id for block in self.blocks]
        self.extra_ids = [[-1 if block is None else block.block_id for block in table] for table in self.extra]
        self.num_announced = self.num_registered
        assert all(len(table) == len(self.blocks) for table in self.extra), "every group's table is as long"

    def extend(self, blocks: list[Block], extra: list[list[Block]] = ()) -> None:
        """Append `blocks` to group 0's table and `extra[k - 1]` (as many) to group k's."""
        assert len(extra) == len(self.extra) and all(len(more) == len(blocks) for more in extra)
        self.blocks.extend(blocks)
        self.block_ids.extend(block.block_id for block in blocks)
        for table, ids, more in zip(self.extra, self.extra_ids, extra):
            table.extend(more)
            ids.extend(block.block_id for block in more)

    def truncate(self, num_blocks: int) -> list[Block]:
        """Drop the blocks past the first `num_blocks` of every group, which must hold nothing announced; the
        dropped ones, group 0's first."""
        assert self.num_announced <= num_blocks and self.load is None, "dropping announced or loading blocks"
        dropped = self.blocks[num_blocks:]
        del self.blocks[num_blocks:], self.block_ids[num_blocks:]
        for table, ids in zip(self.extra, self.extra_ids):
            dropped += [block for block in table[num_blocks:] if block is not None]
            del table[num_blocks:], ids[num_blocks:]
        return dropped

    def release_before(self, group: int, stop: int) -> list[tuple[int, Block]]:
        """Let go of group `group`'s pages before block `stop` (a sliding group's, out of its window); them, with
        their places in the table."""
        table, ids = self.extra[group - 1], self.extra_ids[group - 1]
        released = [(index, block) for index, block in enumerate(table[:stop]) if block is not None]
        for index in range(min(stop, len(table))):
            table[index], ids[index] = None, -1
        return released

    def held(self) -> list[Block]:
        """Every page the request holds, group 0's table first, each table tail first (the order to free them in)."""
        return [*reversed(self.blocks), *(b for table in self.extra for b in reversed(table) if b is not None)]


@dataclass
class PendingFork:
    """A sample admitted with its family's leader, waiting to fork: the block its copy of the
    leader's partly filled last prompt block will go to (None when the prompt fills its blocks)."""

    request: Request
    block: Block | None
    extra: list[Block] = field(default_factory=list)     # with KV groups: the copy's page in groups 1..


class BlockTables:
    """Every request's `RequestBlocks`, the loading index, the announced hashes and the samples' places.

    One prefix is computed once: the full blocks a request holds but has not yet indexed (it is
    computing or loading them) are announced by hash, and a waiting request whose next uncached
    block is announced waits until it is indexed (see `TierManager.waits_for_computing`).
    """

    def __init__(self, enable_prefix_caching: bool):
        self.enable_prefix_caching = enable_prefix_caching
        self.by_request: dict[str, RequestBlocks] = {}
        self.loading: dict[str, RequestBlocks] = {}      # the tables whose request waits on a load
        self.computing: dict[BlockHash, int] = {}        # announced block hashes -> how many requests
        self.forks: dict[str, PendingFork] = {}          # sample id -> its place, until its leader forks it
        # KV groups: requests a lower tier's copy or load failed, holding their pages until the scheduler has
        # them start over (TierManager.take_restarts)
        self.restarts: dict[str, Request] = {}

    def __getitem__(self, request_id: str) -> RequestBlocks:
        return self.by_request[request_id]

    def holds(self, request_id: str) -> bool:
        return request_id in self.by_request

    def add(self, rb: RequestBlocks) -> None:
        """Record a request's table, indexed as loading while it has a load."""
        self.by_request[rb.request.request_id] = rb
        if rb.load is not None:
            self.loading[rb.request.request_id] = rb

    def remove(self, request_id: str) -> RequestBlocks | None:
        """Forget a request's table and withdraw its announcements; the table, or None if it held none."""
        rb = self.by_request.pop(request_id, None)
        self.restarts.pop(request_id, None)
        if rb is not None:
            self.loading.pop(request_id, None)
            self.withdraw(rb, rb.num_registered, rb.num_announced)
        return rb

    def end_load(self, rb: RequestBlocks) -> None:
        """The request's load settled or was given up on: it waits on nothing now."""
        rb.load = None
        del self.loading[rb.request.request_id]

    # ---- announcements --------------------------------------------------------------------------
    def announce(self, rb: RequestBlocks) -> None:
        """Announce rb's full blocks of known tokens past those announced: it is computing them."""
        stop = min(len(rb.blocks), len(rb.request.block_hashes)) if self.enable_prefix_caching else 0
        for index in range(rb.num_announced, stop):
            block_hash = rb.request.block_hashes[index]
            self.computing[block_hash] = self.computing.get(block_hash, 0) + 1
        rb.num_announced = max(rb.num_announced, stop)

    def set_registered(self, rb: RequestBlocks, num_registered: int) -> None:
        """Blocks up to `num_registered` are indexed now (or never will be): withdraw their announcements."""
        self.withdraw(rb, rb.num_registered, min(num_registered, rb.num_announced))
        rb.num_registered = num_registered
        rb.num_announced = max(rb.num_announced, num_registered)

    def withdraw(self, rb: RequestBlocks, start: int, stop: int) -> None:
        for index in range(start, stop):
            block_hash = rb.request.block_hashes[index]
            left = self.computing[block_hash] - 1
            if left:
                self.computing[block_hash] = left
            else:
                del self.computing[block_hash]

    # ---- samples waiting to fork ----------------------------------------------------------------
    def place_forks(self, samples: list[Request], blocks: list[Block], num_groups: int = 1) -> None:
        """Give each sample its place: the block for its copy of the last prompt block, if any (with KV
        groups, `num_groups` pages each, one per group)."""
        for index, sample in enumerate(samples):
            mine = blocks[index * num_groups:(index + 1) * num_groups]
            self.forks[sample.request_id] = PendingFork(sample, mine[0] if mine else None, mine[1:])

    def drop_forks(self, request: Request) -> list[Block]:
        """Forget the place of a sample waiting to fork, or of all its leader's samples (a family
        admitted again after its leader's preemption takes them again); the blocks taken for them."""
        dropped = [sample_id for sample_id, pending in self.forks.items()
                   if pending.request is request or pending.request.family.leader is request]
        places = [self.forks.pop(sample_id) for sample_id in dropped]
        return [block for pending in places for block in ([pending.block] + pending.extra) if block is not None]

    def leads_forks(self, request: Request) -> bool:
        """Whether samples wait to fork from `request`'s prompt (its sliding pages stay until they have)."""
        return any(pending.request.family.leader is request for pending in self.forks.values())
