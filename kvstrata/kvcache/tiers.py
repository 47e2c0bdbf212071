"""`TierManager`: every block a request takes, on every tier, planned before anything is taken.

Admission of a waiting request is two calls (after `prepare`, which starts a store lookup once):

    plan(request, max_new_tokens)  pure: match the prefix tier by tier (device, host, store), count
                                   every block the request will take, decide -> AdmissionPlan | None
    commit(plan)                   take all of it, or (on any exception) none of it

The rule (DESIGN.md §5), with every term counted before anything is taken:

    touched_cached + load_host + load_store + new + reserve  <=  free + cached      (device blocks)

    touched_cached  device hits that are CACHED now: taking them removes them from the evictable side
    load_*          lower-tier hits, each needing a device block to load into
    new             blocks for this chunk's uncached tokens, plus, for the leader of a family of
                    samples (n / best_of), one block per other sample for its copy of the partly
                    filled last prompt block (none when the prompt fills its blocks exactly)
    reserve         decode growth of the requests already holding blocks (and of samples waiting to
                    fork), plus this request's own future beyond this chunk and, for a leader, each
                    other sample's (see DecodeReservation)

A family is admitted whole: the leader's commit takes the copy blocks of every sample inside the
same transaction, so the fork (`fork()`, after the step that samples the first tokens) never
waits for space: it adds one reference to each full prompt block and copies the last block.

A plan records the pool epoch it was computed at; `commit` refuses a stale plan. Running requests
grow with `grow()`, all or nothing and with no reserve: when it fails, the scheduler preempts.

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

Only this class and its parts call the pools; the scheduler sees block ids and counts, never blocks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstrata.core.config import CacheConfig
from kvstrata.core.hashing import BlockHash
from kvstrata.core.request import Request, RequestStatus
from kvstrata.kvcache.block_pool import (
    Block,
    BlockPool,
    BlockState,
    PoolCounts,
)
from kvstrata.kvcache.block_tables import BlockTables, PendingFork, RequestBlocks
from kvstrata.kvcache.guarded_mover import GuardedMover
from kvstrata.kvcache.loads import StoreLoads
from kvstrata.kvcache.store_io import CacheStats, StoreIO
from kvstrata.kvcache.transfers import BlockMover, Executor
from kvstrata.kvcache.write_back import WriteBack


@dataclass
class AdmissionPlan:
    """Everything one admission will take. Computed by `plan()`, consumed once by `commit()`."""

    request: Request
    epoch: int
    hit_blocks: list[Block]            # device prefix hit, in order
    num_touched_cached: int            # hits that are CACHED now
    load_host: list[Block]             # host blocks to copy into fresh device blocks
    load_store: list[BlockHash]        # store records to load into fresh device blocks
    num_new_blocks: int                # blocks for this chunk's uncached tokens
    num_new_tokens: int                # tokens to compute once the loads have landed
    reserve: int                       # blocks kept back for decode growth
    forks: list[Request] = field(default_factory=list)    # a leader's samples waiting to fork
    num_fork_blocks: int = 0           # their copies of the partly filled last prompt block

    @property
    def num_loads(self) -> int:
        return len(self.load_host) + len(self.load_store)

    @property
    def num_hit_tokens(self) -> int:
        """Tokens whose KV comes from a cache tier (device hits plus loads)."""
        return (len(self.hit_blocks) + self.num_loads) * self.request.hasher.block_size

    @property
    def num_blocks_taken(self) -> int:
        return self.num_touched_cached + self.num_loads + self.num_new_blocks + self.num_fork_blocks

    @property
    def num_blocks_needed(self) -> int:
        return self.num_blocks_taken + self.reserve


@dataclass
class DecodeReservation:
    """Blocks kept free at admission for running requests to grow into.

    A request's future KV is its pending tokens (the rest of its prompt, the token just sampled)
    plus `ratio` times the tokens it may still sample (clipped). The ratio starts at `init`, decays
    by `decay` per non-empty step to `floor`, and jumps back to `init` after a preemption: a
    preemption is the sign that the last admissions were too optimistic.
    """

    init: float
    floor: float
    decay: float
    clip_tokens: int
    ratio: float = field(init=False)

    def __post_init__(self) -> None:
        self.ratio = self.init

    @classmethod
    def from_config(cls, config: CacheConfig) -> DecodeReservation:
        return cls(config.reserve_ratio_init, config.reserve_ratio_min, config.reserve_ratio_decay,
                   config.reserve_clip_tokens)

    def on_step(self) -> None:
        self.ratio = max(self.floor, self.ratio - self.decay)

    def on_preemption(self) -> None:
        self.ratio = self.init

    def blocks(self, request: Request, num_tokens_with_kv: int, num_slots: int, block_size: int) -> int:
        """Blocks `request` may still need beyond `num_slots` KV slots, `num_tokens_with_kv` of them filled."""
        pending = request.num_tokens - num_tokens_with_kv
        # The last token a request samples never needs KV, hence the - 1: at ratio 1 a request
        # alone in the pool reserves exactly what add_request checked it could ever need.
        decode_left = min(max(0, request.sampling.max_tokens - request.num_output_tokens - 1), self.clip_tokens)
        future = pending + math.ceil(decode_left * self.ratio)
        return max(0, math.ceil((future - (num_slots - num_tokens_with_kv)) / block_size))


PROBE_WAIT_S = 0.005          # how long plan() waits for a store lookup before deferring the request


class TierManager:
    """Owns the tiers' pools, every request's block table and every transfer record."""

    def __init__(self, config: CacheConfig, num_device_blocks: int, num_host_blocks: int = 0,
                 store=None, mover: BlockMover | None = None, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic, probe_wait: float = PROBE_WAIT_S):
        self.config = config
        self.block_size = config.block_size
        self.device = BlockPool(num_device_blocks, "device")
        self.host = BlockPool(num_host_blocks, "host") if num_host_blocks > 0 else None
        self.store = store
        assert (self.host is None and store is None) or mover is not None, "lower tiers need a BlockMover"
        self.mover = mover
        self.clock = clock
        self._step = 0
        self.reservation = DecodeReservation.from_config(config)
        self.stats = CacheStats()
        self.store_io = None if store is None else StoreIO(
            store, executor or ThreadPoolExecutor(4, thread_name_prefix="kvstrata-store"), clock,
            config.store_timeout, self.stats, probe_wait)
        self.moves = GuardedMover(mover, self.stats) if mover is not None else None
        self.tables = BlockTables(config.enable_prefix_caching)
        self.loads = StoreLoads(config, self.device, self.tables, self.store_io, self.moves, self.stats, clock)
        self.write_back = WriteBack(config, self.device, self.host, self.store_io, self.moves, self.stats)

    # ---- queries (pure) -------------------------------------------------------------------------
    def holds(self, request_id: str) -> bool:
        return self.tables.holds(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table; read-only, and valid until its blocks next change."""
        return self.tables[request_id].block_ids

    def is_loading(self, request_id: str) -> bool:
        return request_id in self.tables.loading

    @property
    def has_transfers(self) -> bool:
        """Loads or writes still running (the engine keeps stepping until they settle)."""
        return self.loads.has_transfers

    def _max_hit_blocks(self, request: Request) -> int:
        """Full blocks a hit may cover: the last token is always computed, for its logits."""
        return (request.num_tokens - 1) // self.block_size if self.config.enable_prefix_caching else 0

    def _match(self, pool: BlockPool | None, request: Request, start: int, stop: int) -> list[Block]:
        if pool is None:
            return []
        size, hits = self.block_size, []
        for index in range(start, stop):
            block = pool.lookup(request.block_hashes[index], request.token_ids[index * size:(index + 1) * size])
            if block is None:
                break
            hits.append(block)
        return hits

    def match_device(self, request: Request) -> list[Block]:
        return self._match(self.device, request, 0, self._max_hit_blocks(request))

    def cached_prefix_tokens(self, request: Request) -> int:
        return len(self.match_device(request)) * self.block_size

    def reserve_for_running(self) -> int:
        """Blocks the requests holding blocks (and the samples waiting to fork) may still grow into."""
        return sum(self.reservation.blocks(rb.request, rb.request.num_computed_tokens,
                                           len(rb.blocks) * self.block_size, self.block_size)
                   for rb in self.tables.by_request.values()) + sum(map(self._fork_reserve, self.tables.forks.values()))

    def _fork_reserve(self, pending: PendingFork | Request) -> int:
        """A sample's decode growth beyond the last prompt block it will hold after the fork."""
        request = pending.request if isinstance(pending, PendingFork) else pending
        slots = math.ceil(request.num_prompt_tokens / self.block_size) * self.block_size
        return self.reservation.blocks(request, request.num_prompt_tokens, slots, self.block_size)

    @property
    def num_pending_forks(self) -> int:
        """Samples admitted with their leader that have not forked yet (each takes a seat)."""
        return len(self.tables.forks)

    def has_fork(self, request_id: str) -> bool:
        return request_id in self.tables.forks

    # ---- admission ------------------------------------------------------------------------------
    def on_step(self, nonempty: bool) -> None:
        self._step += 1
        if nonempty:
            self.reservation.on_step()

    def prepare(self, request: Request) -> bool:
        """Make sure plan() sees an answer from the store about this request's blocks.

        A lookup runs on the store executor, waited for at most `probe_wait` seconds here: False while
        it is out. An answer older than one step is asked again (blocks reach the store all the time). A
        lookup that failed or ran past `store_timeout` answers "no hits", once, is not asked again
        until the next step but one, and the lookup after it is not waited for.
        """
        if self.store_io is None or not self.config.enable_prefix_caching:
            return True
        if self.store_io.needs_lookup(request.request_id, self._step):
            limit = self._max_hit_blocks(request)
            local = len(self._match(self.device, request, 0, limit))
            local += len(self._match(self.host, request, local, limit))
            if local >= limit:
                return True                               # nothing left for the store to supply
            self.store_io.look_up(request.request_id, request.block_hashes[:limit], self._step)
        return self.store_io.answered(request.request_id, self._step)

    def plan(self, request: Request, max_new_tokens: int, whole: bool = False) -> AdmissionPlan | None:
        """Plan admitting `request` with a chunk of at most `max_new_tokens`; None if it does not fit.

        With `whole`, the chunk must reach the end of the request (no chunked prefill). Pure.
        """
        assert request.request_id not in self.tables.by_request, f"{request.request_id} already holds blocks"
        size = self.block_size
        hits, host, store = self._hits(request)
        num_hits = len(hits) + len(host) + len(store)
        if self._computing_block(request, num_hits):
            return None                                   # another request is computing it: wait, then hit
        num_hit_tokens = num_hits * size
        num_new_tokens = min(request.num_tokens - num_hit_tokens, max_new_tokens)
        if num_new_tokens <= 0 or (whole and num_hit_tokens + num_new_tokens < request.num_tokens):
            return None
        num_blocks = math.ceil((num_hit_tokens + num_new_tokens) / size)
        own_future = self.reservation.blocks(request, num_hit_tokens + num_new_tokens, num_blocks * size, size)
        forks = request.family.pending if request.family is not None else []
        assert not any(f.request_id in self.tables.forks for f in forks), "a family's samples are already placed"
        partial_last_block = request.num_prompt_tokens % size != 0
        plan = AdmissionPlan(
            request=request, epoch=self.device.epoch, hit_blocks=hits,
            num_touched_cached=sum(block.state is BlockState.CACHED for block in hits),
            load_host=host, load_store=store,
            num_new_blocks=num_blocks - len(hits) - len(host) - len(store),
            num_new_tokens=num_new_tokens,
            reserve=self.reserve_for_running() + own_future + sum(map(self._fork_reserve, forks)),
            forks=forks, num_fork_blocks=len(forks) if partial_last_block else 0)
        return plan if self.fits(plan) else None

    def _hits(self, request: Request) -> tuple[list[Block], list[Block], list[BlockHash]]:
        """The request's prefix hit, tier by tier: device blocks, then host blocks, then store hashes."""
        limit = self._max_hit_blocks(request)
        hits = self._match(self.device, request, 0, limit)
        host = self._match(self.host, request, len(hits), limit)
        return hits, host, self._store_hits(request, len(hits) + len(host), limit)

    def _computing_block(self, request: Request, index: int) -> bool:
        return index < self._max_hit_blocks(request) and request.block_hashes[index] in self.tables.computing

    def waits_for_computing(self, request: Request) -> bool:
        """Whether the request's next uncached block is one another request is computing (pure).

        plan() refuses such a request; the scheduler lets others pass it meanwhile.
        """
        return self._computing_block(request, sum(map(len, self._hits(request))))

    def _store_hits(self, request: Request, start: int, stop: int) -> list[BlockHash]:
        if self.store_io is None:
            return []
        return self.store_io.hits(request.request_id, request.block_hashes, start, stop)

    def fits(self, plan: AdmissionPlan) -> bool:
        return plan.num_blocks_needed <= self.device.num_available

    def commit(self, plan: AdmissionPlan) -> None:
        """Take every block of the plan as one transaction: on any exception, undo all and re-raise.

        Then come the compensated steps, which never raise (a failure costs recomputation only):
        offload what the allocation evicted, and copy host hits to device.
        """
        request = plan.request
        if plan.epoch != self.device.epoch:
            raise RuntimeError(f"stale plan for {request.request_id}: the pool changed since it was made")
        if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            raise RuntimeError(f"plan for {request.request_id}: the request is {request.status.name}, not waiting")
        if not self.fits(plan) or plan.num_new_tokens < 1:
            raise RuntimeError(f"plan for {request.request_id} does not fit or computes nothing; "
                               "plan() would have refused it")
        undo: list[Callable[[], None]] = []
        try:
            self.device.touch(plan.hit_blocks)
            undo.append(lambda: self.device.free(reversed(plan.hit_blocks)))
            if plan.load_host:
                self.host.touch(plan.load_host)       # pinned: the offload below must not evict them
                undo.append(lambda: self.host.free(plan.load_host))
            got = self.device.allocate(len(plan.load_host) + plan.num_new_blocks + plan.num_fork_blocks)
            assert got is not None, "allocation failed after fits() said yes"
            new_blocks, evicted = got
            undo.append(lambda: (self.device.free(reversed(new_blocks)), self.device.unevict(evicted)))
            flight = self.device.start_transfer(len(plan.load_store))
            assert flight is not None, "load targets unavailable after fits() said yes"
            targets, evicted_for_targets = flight
            undo.append(lambda: ([self.device.end_transfer(block, BlockState.FREE) for block in targets],
                                 self.device.unevict(evicted_for_targets)))
            host_targets = new_blocks[:len(plan.load_host)]
            table = plan.hit_blocks + host_targets + targets + new_blocks[len(plan.load_host):len(new_blocks)
                                                                          - plan.num_fork_blocks]
            self.tables.place_forks(plan.forks, new_blocks[len(new_blocks) - plan.num_fork_blocks:])
            first_admission = request.num_cached_tokens < 0
            load = self.loads.start(request, len(plan.hit_blocks) + len(plan.load_host), plan.load_store, targets,
                                    first_admission)
            rb = RequestBlocks(request, table, len(plan.hit_blocks), load)
            self.tables.add(rb)
        except BaseException:
            self.tables.remove(request.request_id)
            for sample in plan.forks:
                self.tables.forks.pop(sample.request_id, None)
            for step in reversed(undo):
                step()
            raise
        if self.store_io is not None:
            self.store_io.forget_lookup(request.request_id)
        self.write_back.offload_evicted(evicted + evicted_for_targets)
        num_host_loaded = len(host_targets) if self._copy_host_hits(plan, host_targets) else 0
        if num_host_loaded < len(host_targets) and rb.load is not None:
            self.loads.abandon(rb, "behind_failed_copy")  # its blocks follow blocks that are recomputed
        self.tables.set_registered(rb, rb.num_registered + num_host_loaded)
        self.tables.announce(rb)
        request.num_computed_tokens = len(plan.hit_blocks) * self.block_size + num_host_loaded * self.block_size
        if first_admission:
            self.stats.prompt_tokens += request.num_prompt_tokens
            request.num_cached_tokens = 0
            self.stats.count_hits(request, "device", len(plan.hit_blocks) * self.block_size)
            self.stats.count_hits(request, "host", num_host_loaded * self.block_size)

    def _copy_host_hits(self, plan: AdmissionPlan, targets: list[Block]) -> bool:
        """Copy host hits into their device blocks and index them there; whatever happens, unpin the
        host blocks. False if the copy failed: the targets stay ordinary blocks, to be recomputed."""
        if not targets:
            return True
        pairs = [(src.block_id, dst.block_id) for src, dst in zip(plan.load_host, targets)]
        copied = self.moves.copy("host", "device", pairs)
        self.host.free(plan.load_host)                  # unpinned, and now most recently used
        if not copied:
            return False
        for src, dst in zip(plan.load_host, targets):
            self.device.register(dst, src.block_hash, src.token_ids)
        self.stats.count(self.stats.loaded_blocks, "host", len(targets))
        return True

    # ---- growth and release ---------------------------------------------------------------------
    def grow(self, request: Request, num_new_tokens: int) -> bool:
        """Give a request holding blocks room for `num_new_tokens` more tokens. All or nothing."""
        rb = self.tables[request.request_id]
        needed = math.ceil((request.num_computed_tokens + num_new_tokens) / self.block_size) - len(rb.blocks)
        if needed <= 0:
            return True
        got = self.device.allocate(needed)
        if got is None:
            return False
        new_blocks, evicted = got
        rb.extend(new_blocks)
        self.tables.announce(rb)
        self.write_back.offload_evicted(evicted)
        return True

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

    # ---- moving blocks down, persistence ------------------------------------------------------
    @property
    def num_unpersisted(self) -> int:
        """Full blocks not yet written to the store by persist() (some may have left by eviction)."""
        return len(self.write_back.unpersisted)

    def persist(self, limit: int | None = None) -> int:
        return self.write_back.persist(limit)

    # ---- settling loads -------------------------------------------------------------------------
    def poll_loads(self) -> list[Request]:
        return self.loads.poll()

    def wait_for_transfers(self, timeout: float) -> None:
        self.loads.wait(timeout)

    # ---- audit ----------------------------------------------------------------------------------
    def counts(self) -> dict[str, PoolCounts]:
        counts = {"device": self.device.counts()}
        if self.host is not None:
            counts["host"] = self.host.counts()
        return counts

    def audit(self) -> dict[str, PoolCounts]:
        """Check every pool against the block tables and transfer records; raise AuditError naming blocks."""
        holders: dict[int, int] = {}
        in_flight: list[int] = []
        announced: dict[BlockHash, int] = {}
        for rb in self.tables.by_request.values():
            assert not rb.request.is_finished, f"finished request {rb.request.request_id} still holds blocks"
            assert rb.num_registered <= rb.num_announced <= len(rb.blocks), f"{rb.request.request_id} announcements"
            for block_hash in rb.request.block_hashes[rb.num_registered:rb.num_announced]:
                announced[block_hash] = announced.get(block_hash, 0) + 1
            loading = {id(b) for b in rb.load.targets} if rb.load else set()
            assert rb.load is None or rb.load.request is rb.request, "a load record lost its request"
            for block in rb.blocks:
                if id(block) in loading:
                    in_flight.append(block.block_id)
                else:
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for sample_id, pending in self.tables.forks.items():
            leader = pending.request.family.leader
            assert pending.request.status is RequestStatus.AWAITING_FORK and leader.request_id in self.tables.by_request, \
                f"sample {sample_id} has a place but its leader {leader.request_id} holds no blocks"
            if pending.block is not None:
                holders[pending.block.block_id] = holders.get(pending.block.block_id, 0) + 1
        for load in self.loads.orphans:
            assert load.orphaned, "an orphaned load still names a request"
            in_flight.extend(block.block_id for block in load.targets)
        assert len(in_flight) == len(set(in_flight)), "a block is the target of two loads"
        assert {rid for rid, rb in self.tables.by_request.items() if rb.load} == set(self.tables.loading), "loading index is stale"
        assert announced == self.tables.computing, "announced block hashes disagree with the block tables"
        counts = {"device": self.device.audit(holders, in_flight)}
        if self.host is not None:
            counts["host"] = self.host.audit({})
        return counts

    def snapshot(self, with_order: bool = True) -> tuple:
        return (self.device.snapshot(with_order), self.host.snapshot(with_order) if self.host else None,
                tuple(sorted((rid, tuple(self.block_ids(rid))) for rid in self.tables.by_request)))
