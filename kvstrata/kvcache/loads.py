"""Store loads: each started inside commit's transaction and settled on the engine thread when the
store answers or its deadline passes; abandoned when the blocks before it failed to copy, orphaned
when its request lets go first.

A `LoadTransfer` owns its IN_FLIGHT device blocks from start to settlement, whatever happens to the
request meanwhile, so no path frees them twice or never. Records are written into blocks only when
a load settles, on this thread: the executor's answer to an abandoned load is never looked at.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, wait

from kvstrata.core.config import CacheConfig
from kvstrata.core.hashing import BlockHash
from kvstrata.core.request import Request
from kvstrata.kvcache.block_pool import Block, BlockPool, BlockState
from kvstrata.kvcache.block_tables import BlockTables, RequestBlocks
from kvstrata.kvcache.guarded_mover import GuardedMover
from kvstrata.kvcache.store_io import CacheStats, StoreIO
from kvstrata.kvcache.transfers import LoadTransfer

logger = logging.getLogger(__name__)

# The record errors (kvstrata.kvcache.stores.records.REASONS) of a record broken where it lies, deleted by the
# engine that finds it; the others are sound records of another model, KV format, record version or token run
# (a hash collision), left for the engines they belong to.
DAMAGED = ("length", "magic", "checksum", "hash")


class StoreLoads:
    """The store loads in flight: of requests waiting in LOADING (indexed in the block tables), and
    orphans, whose request let go before they landed."""

    def __init__(self, config: CacheConfig, device: BlockPool, tables: BlockTables, store_io: StoreIO | None,
                 moves: GuardedMover | None, stats: CacheStats, clock: Callable[[], float]):
        self.config = config
        self.device = device
        self.tables = tables
        self.store_io = store_io
        self.moves = moves
        self.stats = stats
        self.clock = clock
        self.orphans: list[LoadTransfer] = []

    @property
    def has_transfers(self) -> bool:
        """Loads or writes still running (the engine keeps stepping until they settle)."""
        return bool(self.orphans or self.tables.loading or (self.store_io is not None and self.store_io.has_writes))

    def start(self, request: Request, positions: Sequence[int], hashes: Sequence[BlockHash], targets: list[Block],
              first_admission: bool, num_group0: int | None = None) -> LoadTransfer | None:
        """Record the load of `hashes` into `targets` (the pages of blocks `positions`; with KV groups, group 0's
        `num_group0` first, and the load is whole: kvstrata.kvcache.transfers) and start it.

        Bookkeeping first: if this raises, the caller (commit) rolls back and the executor's result
        is never looked at.
        """
        if not targets:
            return None
        size = self.config.block_size
        tokens = [tuple(request.token_ids[index * size:(index + 1) * size]) for index in positions]
        started = self.clock()
        future = self.store_io.get(list(hashes))
        return LoadTransfer(request, targets, list(hashes), tokens, future, started,
                            started + self.config.store_timeout, first_admission,
                            len(targets) if num_group0 is None else num_group0, num_group0 is not None)

    def abandon(self, rb: RequestBlocks, reason: str) -> None:
        """Give up on the request's store load now: its targets become ordinary blocks of the request."""
        for target in rb.load.targets:
            self.device.end_transfer(target, BlockState.USED)
        self.tables.end_load(rb)
        self.stats.count(self.stats.load_failures, reason)

    def orphan(self, rb: RequestBlocks) -> set[int]:
        """The request let go of its table: its load, if any, settles on its own (its blocks going to
        the cache or back to the free list). The id()s of the blocks the load keeps."""
        if rb.load is None:
            return set()
        rb.load.request = None
        self.orphans.append(rb.load)
        self.stats.orphaned_loads += 1
        return {id(block) for block in rb.load.targets}

    def poll(self) -> list[Request]:
        """Settle every load that finished or timed out; return the requests ready to run. A whole load (KV
        groups) that did not land whole puts its request among the restarts (`BlockTables.restarts`)."""
        ready = []
        for rb in list(self.tables.loading.values()):
            load = rb.load
            loaded = self._settle(load)
            if loaded is None:
                continue
            self.tables.end_load(rb)
            if load.whole and loaded < len(load.targets):
                self.tables.restarts[rb.request.request_id] = rb.request
                continue
            self.tables.set_registered(rb, rb.num_registered + min(loaded, load.num_group0))
            ready.append(rb.request)
        self.orphans = [load for load in self.orphans if self._settle(load) is None]
        if self.store_io is not None:
            self.store_io.settle()
        return ready

    def wait(self, timeout: float) -> None:
        """Block until some transfer may have settled (the engine calls this when it has nothing else)."""
        pending = [rb.load.future for rb in self.tables.loading.values()] + [t.future for t in self.orphans]
        pending += self.store_io.pending() if self.store_io is not None else []
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- settling one load ----------------------------------------------------------------------
    def _settle(self, load: LoadTransfer) -> int | None:
        """Apply a finished load (or give up on a late one); None while it is still running.

        Returns how many leading blocks loaded: those are indexed, the rest become ordinary blocks
        whose tokens the request recomputes. An orphaned load's loaded blocks go to the cache.
        """
        answer = self._answer(load)
        if answer is None:
            return None
        loaded, reason = self._decode(load, *answer)
        if loaded < len(load.targets):
            self.stats.count(self.stats.load_failures, reason or "missing")
        for index, target in enumerate(load.targets):
            ok, publish = index < loaded, index < load.num_group0
            if load.orphaned:
                self.device.end_transfer(target, BlockState.CACHED if ok else BlockState.FREE,
                                         load.hashes[index], load.token_ids[index], publish)
            else:
                self.device.end_transfer(target, BlockState.USED, load.hashes[index] if ok else None,
                                         load.token_ids[index] if ok else None, publish)
        self.stats.count(self.stats.loaded_blocks, "store", loaded)
        self.stats.count(self.stats.group_loads, "store", max(0, loaded - load.num_group0))
        self.stats.load_seconds += self.clock() - load.started
        if not load.orphaned and not (load.whole and loaded < len(load.targets)):
            num_tokens = min(loaded, load.num_group0) * self.config.block_size
            load.request.num_computed_tokens += num_tokens
            if load.first_admission:
                self.stats.count_hits(load.request, "store", num_tokens)
        return loaded

    def _answer(self, load: LoadTransfer) -> tuple[list, str | None] | None:
        """The store's records for a load and why there are none (an error, a timeout); None while it runs."""
        if load.future.done():
            try:
                return load.future.result(), None
            except Exception as exc:
                self.store_io.error(exc)
                return [], "error"
        if self.clock() >= load.deadline:
            return [], "timeout"
        return None

    def _decode(self, load: LoadTransfer, records: list, reason: str | None) -> tuple[int, str | None]:
        """Write the records into the targets in order, up to the first missing or unusable one (a damaged
        record is deleted from the store; a sound one of another engine, version or token run is left to its
        own); how many were written, and why not the rest (one reason)."""
        loaded = 0
        for target, block_hash, tokens, record in zip(load.targets, load.hashes, load.token_ids, records):
            if record is None:
                return loaded, "missing"
            try:
                self.moves.mover.decode_into("device", target.block_id, record, block_hash, tokens)
            except Exception as exc:
                bad = getattr(exc, "reason", None)
                if bad is None:                           # not the record's fault: keep it
                    self.moves.fault("decode", exc)
                    return loaded, "decode"
                if bad in DAMAGED:
                    logger.warning("dropping a damaged store record (%s): %s", bad, exc)
                    self.store_io.delete(block_hash)
                return loaded, bad
            loaded += 1
        return loaded, reason
