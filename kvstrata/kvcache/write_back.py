"""Moving blocks down the tiers (DESIGN.md §3.9): a device block evicted while CACHED is copied to
host and a host block evicted is written to the store (write-back); with write-through, a block
goes to host and store as soon as it is full. With `persist`, the full blocks still on device or
host are written to the store on demand, so a process that stops does not take its cache with it.

Each move is a compensated step, never part of a transaction: host slots are taken, then copied
into, and a failed copy frees them again (the evicted KV is simply not kept); a failed encode or
put writes nothing, and a write that fails or times out is forgotten as stored, so a later
eviction writes the block again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvstrata.core.config import CacheConfig
from kvstrata.core.hashing import BlockHash
from kvstrata.kvcache.block_pool import Block, BlockPool, EvictedBlock
from kvstrata.kvcache.guarded_mover import GuardedMover
from kvstrata.kvcache.store_io import CacheStats, StoreIO

MAX_UNPERSISTED = 16384        # full blocks remembered for persist(); the oldest are forgotten beyond


class WriteBack:
    """Writes blocks down to host and store, and remembers the full blocks not yet persisted."""

    def __init__(self, config: CacheConfig, device: BlockPool, host: BlockPool | None, store_io: StoreIO | None,
                 moves: GuardedMover | None, stats: CacheStats):
        self.config = config
        self.device = device
        self.host = host
        self.store_io = store_io
        self.moves = moves
        self.stats = stats
        self.unpersisted: OrderedDict[BlockHash, tuple[int, ...]] = OrderedDict()   # see persist()

    def offload_evicted(self, evicted: Sequence[EvictedBlock]) -> None:
        """Write-back: copy device blocks evicted from the cache to host (or straight to the store); not a stale
        one (a sliding page no likely hit reads, kvstrata.kvcache.growth): it would push out pages hits read."""
        self.stats.count(self.stats.evicted_blocks, "device", len(evicted))
        evicted = [item for item in evicted if not item.stale]
        if not evicted:
            return
        if self.host is None:
            for item in evicted:
                self._write_to_store("device", item.block_id, item.block_hash, item.token_ids)
            return
        todo = [item for item in evicted if not self.host.contains(item.block_hash)]
        todo = todo[:self.host.num_available]
        if not todo:
            return
        slots, host_evicted = self.host.allocate(len(todo))
        self._store_host_evictions(host_evicted)
        if not self.moves.copy("device", "host", [(item.block_id, slot.block_id) for item, slot in zip(todo, slots)]):
            self.host.free(slots)                       # unhashed: back to FREE; the evicted KV is not kept
            return
        for item, slot in zip(todo, slots):
            self.host.register(slot, item.block_hash, item.token_ids, item.published)
        self.host.free(slots)
        self.stats.count(self.stats.offloaded_blocks, "host", len(slots))

    def write_through(self, block: Block) -> None:
        """Copy a block that just became full to host (and on to the store) while it stays on device."""
        if self.host is None:
            self._write_to_store("device", block.block_id, block.block_hash, block.token_ids)
            return
        if self.host.contains(block.block_hash):
            return
        got = self.host.allocate(1) if self.host.num_available else None
        if got is None:
            return
        (slot,), host_evicted = got
        self._store_host_evictions(host_evicted)
        if not self.moves.copy("device", "host", [(block.block_id, slot.block_id)]):
            self.host.free([slot])
            return
        self.host.register(slot, block.block_hash, block.token_ids, block.published)
        self.host.free([slot])
        self.stats.count(self.stats.offloaded_blocks, "host", 1)
        self._write_to_store("host", slot.block_id, block.block_hash, block.token_ids)

    def _store_host_evictions(self, evicted: Sequence[EvictedBlock]) -> None:
        """Host blocks about to be overwritten: their record goes to the store first (write-back)."""
        self.stats.count(self.stats.evicted_blocks, "host", len(evicted))
        if self.config.write_policy == "write_back":
            for item in evicted:
                self._write_to_store("host", item.block_id, item.block_hash, item.token_ids)

    def _write_to_store(self, tier: str, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Snapshot the block's record now (its buffer may be reused next) and write it off the step loop.

        A block this engine wrote (or is writing) is not written twice; a write that fails or runs
        past its deadline is forgotten, so a later eviction of the block writes it again.
        """
        if self.store_io is None or self.store_io.wrote(block_hash):
            return
        if not self.store_io.has_room():
            self.stats.dropped_writes += 1
            return
        record = self.moves.encode(tier, block_id, block_hash, token_ids)
        if record is not None:
            self.store_io.put(block_hash, record)

    # ---- persistence ----------------------------------------------------------------------------
    # Write-back sends a block to the store only when host evicts it, so a process that stops
    # before that takes its cache with it. With `persist`, every block that becomes full is
    # remembered, and persist() writes the ones still on device or host to the store; the engine
    # calls it when it has nothing else to do and, with no limit, at close. A block that left both
    # tiers meanwhile went to the store by eviction (or was lost with a dropped write).
    def remember_unpersisted(self, block: Block) -> None:
        if self.store_io is None or not self.config.persist or self.store_io.wrote(block.block_hash):
            return
        self.unpersisted[block.block_hash] = block.token_ids
        if len(self.unpersisted) > MAX_UNPERSISTED:
            self.unpersisted.popitem(last=False)

    def persist(self, limit: int | None = None) -> int:
        """Start store writes for up to `limit` remembered blocks, oldest first; how many started.

        Stops early while MAX_PENDING_WRITES writes are out, so nothing is dropped for lack of room:
        the rest waits for the next call.
        """
        started = 0
        while self.unpersisted and (limit is None or started < limit) and self.store_io.has_room():
            block_hash, token_ids = self.unpersisted.popitem(last=False)
            started += self.write_held(block_hash, token_ids)
        return started

    def write_held(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> bool:
        """Write a block still held on device or host (CACHED or USED) to the store, unless this engine
        wrote it already; whether the block was found."""
        for tier, pool in (("device", self.device), ("host", self.host)):
            block = pool.lookup(block_hash, token_ids) if pool is not None else None
            if block is not None:
                self._write_to_store(tier, block.block_id, block_hash, token_ids)
                return True
        return False
