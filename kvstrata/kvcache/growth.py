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
from kvstrata.kvcache.kv_groups import KVGroups, group_hash
from kvstrata.kvcache.loads import StoreLoads
from kvstrata.kvcache.store_io import CacheStats, StoreIO
from kvstrata.kvcache.write_back import WriteBack


class Growth:
    """Changes the blocks of requests that hold some."""

    def __init__(self, config: CacheConfig, *, device: BlockPool, tables: BlockTables, loads: StoreLoads,
                 write_back: WriteBack, moves: GuardedMover | None, store_io: StoreIO | None,
                 stats: CacheStats, groups: KVGroups | None = None):
        self.stats = stats
        self.groups = groups if groups is not None and groups.num_groups > 1 else None
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
            got = self.device.allocate(needed * (1 + len(rb.extra)))      # a page in every group
            if got is None:
                return False
            new_blocks, evicted = got
            rb.extend(new_blocks[:needed],
                      [new_blocks[needed * k:needed * (k + 1)] for k in range(1, 1 + len(rb.extra))])
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
        """Index the request's blocks whose every token now has KV, so others can hit them; then, with KV
        groups, let go of the sliding groups' pages no later token reads (cached, for a later hit's window)."""
        rb = self.tables[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        if self.config.enable_prefix_caching:
            size = self.block_size
            for index in range(rb.num_registered, num_full):
                tokens = request.token_ids[index * size:(index + 1) * size]
                for group, table in enumerate([rb.blocks, *rb.extra]):
                    block = table[index]
                    if block is not None and self.device.register(block, group_hash(request.block_hashes[index], group),
                                                                  tokens, publish=group == 0):
                        if self.config.write_policy == "write_through":
                            self.write_back.write_through(block)
                        self.write_back.remember_unpersisted(block)
        self.tables.set_registered(rb, max(rb.num_registered, num_full))
        self._leave_window(rb)

    def _leave_window(self, rb: RequestBlocks) -> None:
        """With KV groups, give back the sliding groups' pages before their window: no later token of the request
        reads them. Cached ones stay cached for a later hit's window, but only those of two windows are kept as
        long as any page: the prompt's last (what the same prompt sent again needs) and the one ending where the
        prompt left a prefix a tier held at its admission (what the next prompt sharing that prefix needs: a
        system prompt, a shared preamble); the others are evicted first (the window a conversation's next turn
        needs is the request's last, given back when it ends). Not while samples wait to fork from the request's
        prompt: one whose copy of the last block fails recomputes it from the window before."""
        if self.groups is None or self.tables.leads_forks(rb.request):
            return
        size, request = self.block_size, rb.request
        resent = (request.num_prompt_tokens - 1) // size          # the hit of the same prompt again, in blocks
        shared = request.num_shared_blocks                         # the hit of the next prompt sharing its prefix
        for group in range(1, self.groups.num_groups):
            stop = self.groups.first_needed(group, request.num_computed_tokens, size)
            keep = (range(self.groups.first_needed(group, resent * size, size), request.num_prompt_tokens // size),
                    range(self.groups.first_needed(group, shared * size, size), shared))
            released = rb.release_before(group, stop)
            self.stats.window_released += len(released)
            self.device.free([block for index, block in released if not any(index in w for w in keep)], stale=True)
            self.device.free([block for index, block in released if any(index in w for w in keep)])

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
        extra_shared = [table[:num_full] for table in source.extra]
        self.device.touch(shared + [block for table in extra_shared for block in table if block is not None])
        rb = RequestBlocks(sample, shared + ([pending.block] if pending.block is not None else []), num_full,
                           extra=[table + pending.extra[k:k + 1] for k, table in enumerate(extra_shared)])
        self.tables.add(rb)
        pairs = [] if pending.block is None else [(source.blocks[num_full].block_id, pending.block.block_id)] + [
            (table[num_full].block_id, page.block_id) for table, page in zip(source.extra, pending.extra)]
        copied = pending.block is None or (self.moves is not None and self.moves.copy("device", "device", pairs))
        sample.num_computed_tokens = num_prompt if copied else num_full * size
        self.tables.announce(rb)
        self._leave_window(rb)
        self._leave_window(source)          # once its last sample forked

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
        self.device.free(block for block in rb.held() if id(block) not in in_flight)
