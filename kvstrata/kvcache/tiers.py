"""`TierManager`: every block a request takes, on every tier, planned before anything is taken.

Admission of a waiting request is two calls (after `prepare`, which starts a store lookup once):

    plan(request, max_new_tokens)  pure: match the prefix tier by tier (device, host, store), count
                                   every block the request will take, decide -> AdmissionPlan | None
    commit(plan)                   take all of it, or (on any exception) none of it

The rule (DESIGN.md §5), with every term counted before anything is taken:

    touched_cached + load_host + load_store + new + reserve  <=  free + cached      (device blocks)

    touched_cached  device hits that are CACHED now: taking them removes them from the evictable side
    load_*          lower-tier hits, each needing a device block to load into (with KV groups, every group's pages)
    new             blocks for this chunk's uncached tokens, plus, for the leader of a family of
                    samples (n / best_of), one block per other sample for its copy of the partly
                    filled last prompt block (none when the prompt fills its blocks exactly)
    reserve         decode growth of the requests already holding blocks (and of samples waiting to
                    fork), plus this request's own future beyond this chunk and, for a leader, each
                    other sample's; a request that speculates counts the K slots of its drafts too
                    (see DecodeReservation)

A family is admitted whole: the leader's commit takes the copy blocks of every sample inside the
same transaction, so the fork (`fork()`, after the step that samples the first tokens) never
waits for space: it adds one reference to each full prompt block and copies the last block.

A plan records the pool epoch it was computed at; `commit` refuses a stale plan. Running requests
grow with `grow()`, all or nothing and with no reserve: when it fails, the scheduler preempts.

Speculative steps (DESIGN.md §2): a decode that verifies K draft tokens grows by 1 + K slots in the
same all-or-nothing `grow()` (if that fails, the step decodes without drafts: drafts never preempt);
after verification `settle_drafts()` frees every block past the accepted tokens, so a rejection that
crosses a block boundary returns that block. A draft is not in the request's ledger until accepted:
it has no hash, so its KV is never announced, indexed, offloaded, persisted or published. Release
(abort, preemption) in the middle of the step returns the draft slots with everything else.

One prefix is computed once: the full blocks a request holds but has not yet indexed (it is
computing or loading them) are announced by hash; a waiting request whose next uncached block is
announced is not admitted until that block is indexed, and then hits it instead of computing it
a second time.

Moving KV (DESIGN.md §3.9): a device block evicted while CACHED is copied to the host tier
(write-back); a host block evicted is written to the store. With write-through, a block goes to
host and store as soon as it is full. Host hits are copied to device inside the step; store hits
load on an executor while the request waits in LOADING, and a load that fails, times out or finds
a bad record turns its blocks into ordinary new blocks whose tokens are recomputed.

Faults (a copy, an encode or a store call that raises or never answers) cost recomputation, never a
block. Each side effect is either inside a transaction or a compensated step:

    commit()            pool changes + starting the store load: one transaction, undone on any exception
    offload / write-through   host slots are taken, then copied into; a failed copy frees them again
                        (the evicted KV is simply not kept), a failed encode or put writes nothing
    host hits           copied after the transaction; a failed copy leaves the device blocks as ordinary
                        blocks to recompute, and abandons a store load queued behind them
    store calls         every lookup, load and write has a deadline; a write that fails or times out is
                        forgotten as stored, so a later eviction writes the block again

With KV groups a hit takes each group's pages from whichever tier holds them (group_match.py), and a failed
host copy or store load sends the request back to wait instead (`take_restarts`): a sliding group holds no
page before its window to recompute a failed block from.

Only this class and its parts call the pools; the scheduler sees block ids and counts, never blocks.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvstrata.core.config import CacheConfig
from kvstrata.core.hashing import BlockHash
from kvstrata.core.request import Request
from kvstrata.kvcache.admission import Admission, AdmissionPlan, DecodeReservation
from kvstrata.kvcache.audit import audit_tiers, pool_counts, snapshot_tiers
from kvstrata.kvcache.block_pool import Block, BlockPool, PoolCounts
from kvstrata.kvcache.block_tables import BlockTables
from kvstrata.kvcache.growth import Growth
from kvstrata.kvcache.guarded_mover import GuardedMover
from kvstrata.kvcache.kv_groups import KVGroups, group_hash
from kvstrata.kvcache.loads import StoreLoads
from kvstrata.kvcache.store_io import CacheStats, StoreIO
from kvstrata.kvcache.transfers import BlockMover, Executor
from kvstrata.kvcache.write_back import WriteBack

logger = logging.getLogger(__name__)

PROBE_WAIT_S = 0.005          # how long plan() waits for a store lookup before deferring the request


class TierManager:
    """Owns the tiers' pools, every request's block table and every transfer record.

    The work is done by parts, each holding only what its job needs, wired here:

        tables       who holds which blocks, the announced hashes, the samples' places   block_tables.py
        admission    prepare, plan, commit with its rollback, host-hit copies              admission.py
        growth       grow, cache_full_blocks, fork, release                                growth.py
        loads        store loads: start, settle, abandon, orphan; waiting for transfers    loads.py
        write_back   offload on eviction, write-through, store writes, persist            write_back.py

    and the audit (audit.py) reads them all. The methods below are the tier manager's whole API.
    """

    def __init__(self, config: CacheConfig, num_device_blocks: int, num_host_blocks: int = 0,
                 store=None, mover: BlockMover | None = None, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic, probe_wait: float = PROBE_WAIT_S,
                 groups: KVGroups | None = None, max_chunk_tokens: int | None = None):
        self.config = config
        self.groups = groups if groups is not None and groups.num_groups > 1 else None   # None: one table a request
        self.block_size = config.block_size
        self.device = BlockPool(num_device_blocks, "device")
        self.host = BlockPool(num_host_blocks, "host") if num_host_blocks > 0 else None
        self.store = store
        assert (self.host is None and store is None) or mover is not None, "lower tiers need a BlockMover"
        self.mover = mover
        self.clock = clock
        self.reservation = DecodeReservation.from_config(config)
        self.stats = CacheStats()
        self.store_io = None if store is None else StoreIO(
            store, executor or ThreadPoolExecutor(4, thread_name_prefix="kvstrata-store"), clock,
            config.store_timeout, self.stats, probe_wait)
        moves = GuardedMover(mover, self.stats) if mover is not None else None
        self.tables = BlockTables(config.enable_prefix_caching)
        self.loads = StoreLoads(config, self.device, self.tables, self.store_io, moves, self.stats, clock)
        self.write_back = WriteBack(config, self.device, self.host, self.store_io, moves, self.stats)
        self.admission = Admission(config, device=self.device, host=self.host, store_io=self.store_io,
                                   tables=self.tables, reservation=self.reservation, loads=self.loads,
                                   write_back=self.write_back, moves=moves, stats=self.stats, groups=self.groups,
                                   max_chunk_tokens=max_chunk_tokens)
        self.growth = Growth(config, device=self.device, tables=self.tables, loads=self.loads,
                             write_back=self.write_back, moves=moves, store_io=self.store_io, stats=self.stats,
                             groups=self.groups)

    # ---- queries (pure) -------------------------------------------------------------------------
    def holds(self, request_id: str) -> bool:
        return self.tables.holds(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table; read-only, and valid until its blocks next change."""
        return self.tables[request_id].block_ids

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """With KV groups, the block tables of groups 1.. (-1: a page a sliding group let go); read-only."""
        return self.tables[request_id].extra_ids

    def pages_for(self, request: Request, num_samples: int, max_chunk: int) -> int:
        """Most pages `request` and its family's `num_samples` samples take alone, each computing at most
        `max_chunk` tokens a step (the full prompt blocks held once)."""
        blocks = math.ceil((request.max_total_tokens - 1) / self.block_size)
        shared = request.num_prompt_tokens // self.block_size
        return self._pages(blocks, max_chunk) + (num_samples - 1) * self._pages(blocks - shared, max_chunk)

    def _pages(self, num_blocks: int, max_chunk: int) -> int:
        """Most pages one sequence of `num_blocks` blocks takes, computed `max_chunk` tokens at a time."""
        groups = self.groups
        if groups is None:
            return num_blocks
        return num_blocks + sum(groups.peak_blocks(group, num_blocks, max_chunk, self.block_size)
                                for group in range(1, groups.num_groups))

    def is_loading(self, request_id: str) -> bool:
        """Whether the request waits on a load, or (KV groups) to start over after one failed."""
        return request_id in self.tables.loading or request_id in self.tables.restarts

    @property
    def has_transfers(self) -> bool:
        """Loads or writes still running (the engine keeps stepping until they settle)."""
        return self.loads.has_transfers

    def match_device(self, request: Request) -> list[Block]:
        return self.admission.match_device(request)

    def cached_prefix_tokens(self, request: Request) -> int:
        return len(self.match_device(request)) * self.block_size

    def reserve_for_running(self) -> int:
        """Blocks the requests holding blocks (and the samples waiting to fork) may still grow into."""
        return self.admission.reserve_for_running()

    @property
    def num_pending_forks(self) -> int:
        """Samples admitted with their leader that have not forked yet (each takes a seat)."""
        return len(self.tables.forks)

    def has_fork(self, request_id: str) -> bool:
        return request_id in self.tables.forks

    def waits_for_computing(self, request: Request) -> bool:
        """Whether the request's next uncached block is one another request is computing (pure)."""
        return self.admission.waits_for_computing(request)

    # ---- admission (admission.py) ---------------------------------------------------------------
    def on_step(self, nonempty: bool) -> None:
        self.admission.on_step(nonempty)

    def prepare(self, request: Request) -> bool:
        """Make sure plan() sees an answer from the store about this request's blocks."""
        return self.admission.prepare(request)

    def plan(self, request: Request, max_new_tokens: int, whole: bool = False) -> AdmissionPlan | None:
        """Plan admitting `request` with a chunk of at most `max_new_tokens`; None if it does not fit. Pure."""
        return self.admission.plan(request, max_new_tokens, whole)

    def fits(self, plan: AdmissionPlan) -> bool:
        return self.admission.fits(plan)

    def commit(self, plan: AdmissionPlan) -> None:
        """Take every block of the plan as one transaction: on any exception, undo all and re-raise."""
        self.admission.commit(plan)

    # ---- growth and release (growth.py) ---------------------------------------------------------
    def grow(self, request: Request, num_new_tokens: int, num_draft_tokens: int = 0) -> bool:
        """Give a request holding blocks room for `num_new_tokens` more tokens (and `num_draft_tokens`
        draft slots after them in a speculative step). All or nothing."""
        return self.growth.grow(request, num_new_tokens, num_draft_tokens)

    def settle_drafts(self, request: Request) -> None:
        """Give back the slots of a speculative step's rejected drafts, whole blocks past the computed tokens."""
        self.growth.settle_drafts(request)

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks whose every token now has KV, so others can hit them."""
        self.growth.cache_full_blocks(request)

    def fork(self, leader: Request, sample: Request) -> None:
        """Give `sample` the leader's prompt, in the place taken for it at admission."""
        self.growth.fork(leader, sample)

    def release(self, request: Request) -> None:
        """Return every block the request holds, tail first; a pending load is left to settle on its own."""
        self.growth.release(request)

    # ---- moving blocks down, persistence (write_back.py) ----------------------------------------
    @property
    def num_unpersisted(self) -> int:
        """Full blocks not yet written to the store by persist() (some may have left by eviction)."""
        return len(self.write_back.unpersisted)

    def persist(self, limit: int | None = None) -> int:
        """Start store writes for up to `limit` remembered blocks, oldest first; how many started."""
        return self.write_back.persist(limit)

    # ---- handing KV over to another engine (docs/design/disaggregation.md) ----------------------
    def hand_off(self, request: Request) -> list[BlockHash]:
        """Write the request's prompt blocks another engine would load to the store: the full blocks
        before the last prompt token (which that engine computes for its logits), those this engine
        has not written yet and still holds (right after the request ends, all of them); with KV groups, every
        group's pages that hit needs, group 0's last. Group 0's hashes, in order; `stored_run` says how many of
        them have landed."""
        size = self.block_size
        hashes = request.block_hashes[:(request.num_prompt_tokens - 1) // size]
        if self.store_io is None:
            return hashes
        groups = self.groups.num_groups if self.groups is not None else 1
        for group in [*range(1, groups), 0]:        # with KV groups, the pages the hit needs; group 0's last
            first = self.groups.first_needed(group, len(hashes) * size, size) if group else 0
            for index in range(first, len(hashes)):
                key = group_hash(hashes[index], group)
                if not self.store_io.wrote(key):
                    self.write_back.write_held(key, tuple(request.token_ids[index * size:(index + 1) * size]))
        return hashes

    def stored_run(self, hashes: list[BlockHash]) -> tuple[int, bool]:
        """How many of `hashes`, from the first, are in the store by this engine's writes, and whether a
        write that could lengthen that run is still out (each write has the store's deadline)."""
        if self.store_io is None:
            return 0, False
        return self.store_io.landed_run(hashes)

    # ---- settling loads (loads.py) --------------------------------------------------------------
    def poll_loads(self) -> list[Request]:
        """Settle every load that finished or timed out; return the requests ready to run."""
        return self.loads.poll()

    def take_restarts(self) -> list[Request]:
        """With KV groups, the requests a lower tier's copy or load failed: each is to give back every page and
        wait again (the scheduler preempts it), its next admission taking device hits only, so it cannot fail
        twice. A sliding group holds no page before its window, so a block that failed to load cannot be
        recomputed from the blocks before it, as it is without groups."""
        restarts = list(self.tables.restarts.values())
        self.tables.restarts.clear()
        for request in restarts:
            logger.info("%s: a copy or load from a lower tier failed; it gives its pages back and waits again, "
                        "its next admission taking device hits only", request.request_id)
            request.device_hits_only = True
        self.stats.restarts += len(restarts)
        return restarts

    def wait_for_transfers(self, timeout: float) -> None:
        """Block until some transfer may have settled (the engine calls this when it has nothing else)."""
        self.loads.wait(timeout)

    # ---- audit (audit.py) -----------------------------------------------------------------------
    def counts(self) -> dict[str, PoolCounts]:
        return pool_counts(self.device, self.host)

    def audit(self) -> dict[str, PoolCounts]:
        """Check every pool against the block tables and transfer records; raise AuditError naming blocks."""
        return audit_tiers(self.tables, self.loads.orphans, self.device, self.host, self.block_size, self.groups)

    def snapshot(self, with_order: bool = True) -> tuple:
        return snapshot_tiers(self.tables, self.device, self.host, with_order)
