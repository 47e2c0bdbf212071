"""Growth and release: what happens to a request's device blocks between its admission and its end.

It grows into more blocks as it computes (all or nothing, with no reserve: when that fails, the
scheduler preempts), takes slots for a speculative step's draft tokens the same way and gives back
those of rejected drafts after verification, indexes each block once its every token has KV, gives its family's samples
their prompt (`fork`), and at the end gives every block back, tail first, so the least reusable end
of a chain is evicted first.
"""

from __future__ import annotations

import math

from kvstrata.core.config import CacheConfig
from kvstrata.core.request import Request
from kvstrata.kvcache.block_pool import BlockPool
from kvstrata.kvcache.block_tables import BlockTables, RequestBlocks
from kvstrata.kvcache.guarded_mover import GuardedMover
from kvstrata.kvcache.loads import StoreLoads
from kvstrata.kvcache.store_io import StoreIO
from kvstrata.kvcache.write_back import WriteBack


class Growth:
    """Changes the blocks of requests that hold some."""

    def __init__(self, config: CacheConfig, *, device: BlockPool, tables: BlockTables, loads: StoreLoads,
                 write_back: WriteBack, moves: GuardedMover | None, store_io: StoreIO | None):
        self.config = config
        self.block_size = config.block_size
        self.device = device
        self.tables = tables
        self.loads = loads
        self.write_back = write_back
        self.moves = moves
        self.store_io = store_io

    def grow(self, request: Request, num_new_tokens: int, num_draft_tokens: int = 0) -> bool:
        """Give a request holding blocks room for `num_new_tokens` more tokens and, in a speculative
        step, `num_draft_tokens` drafts after them. All or nothing."""
        rb = self.tables[request.request_id]
        assert rb.num_draft_tokens == 0 or num_draft_tokens == 0, f"{request.request_id} already holds drafts"
        num_slots = request.num_computed_tokens + num_new_tokens + num_draft_tokens
        needed = math.ceil(num_slots / self.block_size) - len(rb.blocks)
        if needed > 0:
            got = self.device.allocate(needed)
            if got is None:
                return False
            new_blocks, evicted = got
            rb.extend(new_blocks)
            self.tables.announce(rb)            # full blocks of known tokens only: drafts have no hash
            self.write_back.offload_evicted(evicted)
        rb.num_draft_tokens = num_draft_tokens
        return True

    def settle_drafts(self, request: Request) -> None:
        """After verification (the accepted drafts are in the ledger and counted as computed): give
        back every block past those the computed tokens fill, as if the rejected drafts never ran."""
        rb = self.tables[request.request_id]
        assert rb.num_draft_tokens > 0, f"{request.request_id} holds no draft slots"
        rejected = rb.truncate(math.ceil(request.num_computed_tokens / self.block_size))
        self.device.free(reversed(rejected))
        rb.num_draft_tokens = 0

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks whose every token now has KV, so others can hit them."""
        rb = self.tables[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        if not self.config.enable_prefix_caching:
            self.tables.set_registered(rb, num_full)
            return
        size = self.block_size
        for index in range(rb.num_registered, num_full):
            block = rb.blocks[index]
            tokens = request.token_ids[index * size:(index + 1) * size]
            if self.device.register(block, request.block_hashes[index], tokens):
                if self.config.write_policy == "write_through":
                    self.write_back.write_through(block)
                self.write_back.remember_unpersisted(block)
        self.tables.set_registered(rb, max(rb.num_registered, num_full))

    def fork(self, leader: Request, sample: Request) -> None:
        """Give `sample` the leader's prompt: one more reference to each full prompt block, and a copy
        of the partly filled last one in the block taken for it at admission. Never raises for space.

        Call after the step that computed the leader's last prompt token. If the copy fails, the
        sample's last block is an ordinary block and it recomputes those few tokens.
        """
        pending = self.tables.forks.pop(sample.request_id)
        source = self.tables[leader.request_id]
        size, num_prompt = self.block_size, leader.num_prompt_tokens
        num_full = num_prompt // size
        assert leader.num_computed_tokens >= num_prompt and source.num_registered >= num_full, \
            f"{leader.request_id} forks before its prompt is computed"
        shared = source.blocks[:num_full]
        self.device.touch(shared)
        rb = RequestBlocks(sample, shared + ([pending.block] if pending.block is not None else []), num_full)
        self.tables.add(rb)
        copied = pending.block is None or (self.moves is not None and self.moves.copy(
            "device", "device", [(source.blocks[num_full].block_id, pending.block.block_id)]))
        sample.num_computed_tokens = num_prompt if copied else num_full * size
        self.tables.announce(rb)

    def release(self, request: Request) -> None:
        """Return every block the request holds, tail first; a pending load is left to settle on its own."""
        if self.store_io is not None:
            self.store_io.forget_lookup(request.request_id)
        for block in self.tables.drop_forks(request):
            self.device.free([block])
        rb = self.tables.remove(request.request_id)
        if rb is None:
            return
        in_flight = self.loads.orphan(rb)
        self.device.free(block for block in reversed(rb.blocks) if id(block) not in in_flight)
