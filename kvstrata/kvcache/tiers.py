"""`TierManager`: every block a request takes, on every tier, planned before anything is taken.

Admission of a waiting request is two calls (after `prepare`, which starts a store lookup once):

    plan(request, max_new_tokens)  pure: match the prefix tier by tier (device, host, store), count
                                   every block the request will take, decide -> AdmissionPlan | None
    commit(plan)                   take all of it, or (on any exception) none of it

The rule (DESIGN.md §5), with every term counted before anything is taken:

    touched_cached + load_host + load_store + new + reserve  <=  free + cached      (device blocks)

    touched_cached  device hits that are CACHED now: taking them removes them from the evictable side
    load_*          lower-tier hits, each needing a device block to load into
    new             blocks for this chunk's uncached tokens
    reserve         decode growth of the requests already holding blocks, plus this request's own
                    future beyond this chunk (see DecodeReservation)

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

Only this class calls the pools; the scheduler sees block ids and counts, never blocks.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from kvstrata.config import CacheConfig
from kvstrata.kvcache.block_pool import Block, BlockPool, BlockState, EvictedBlock, PoolCounts
from kvstrata.kvcache.hashing import BlockHash
from kvstrata.kvcache.transfers import BlockMover, Executor, LoadTransfer
from kvstrata.request import Request, RequestStatus

logger = logging.getLogger(__name__)

MAX_UNPERSISTED = 16384        # full blocks remembered for persist(); the oldest are forgotten beyond
MAX_PENDING_WRITES = 256        # store writes queued (or abandoned and still running) beyond this are dropped
REMEMBERED_STORED = 65536       # hashes known to be in the store, so they are not written twice


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

    @property
    def num_loads(self) -> int:
        return len(self.load_host) + len(self.load_store)

    @property
    def num_hit_tokens(self) -> int:
        """Tokens whose KV comes from a cache tier (device hits plus loads)."""
        return (len(self.hit_blocks) + self.num_loads) * self.request.hasher.block_size

    @property
    def num_blocks_taken(self) -> int:
        return self.num_touched_cached + self.num_loads + self.num_new_blocks

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


@dataclass
class RequestBlocks:
    """A request's device block table, how many of its blocks are indexed, and its pending load.

    `block_ids` mirrors `blocks` as plain ints, kept in step, so handing the table to the runner
    every step costs nothing. Blocks [num_registered, num_announced) are full blocks of known
    tokens that the request is computing or loading: their hashes are in `TierManager._computing`.
    """

    request: Request
    blocks: list[Block]
    num_registered: int = 0
    load: LoadTransfer | None = None
    block_ids: list[int] = field(init=False)
    num_announced: int = field(init=False)

    def __post_init__(self) -> None:
        self.block_ids = [block.block_id for block in self.blocks]
        self.num_announced = self.num_registered

    def extend(self, blocks: list[Block]) -> None:
        self.blocks.extend(blocks)
        self.block_ids.extend(block.block_id for block in blocks)


@dataclass
class CacheStats:
    """Counters since start, read by metrics and benchmarks."""

    prompt_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "store": 0})
    evicted_blocks: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    offloaded_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "store": 0})
    loaded_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "store": 0})
    load_failures: dict[str, int] = field(default_factory=dict)      # by reason
    store_errors: dict[str, int] = field(default_factory=dict)       # by kind
    faults: dict[str, int] = field(default_factory=dict)             # copies / encodes / decodes that raised
    dropped_writes: int = 0
    orphaned_loads: int = 0            # loads whose request let go before they landed
    load_seconds: float = 0.0

    def count(self, table: dict[str, int], key: str, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n


@dataclass
class _Probe:
    """Which of a request's block hashes the store holds: the last answer, and a lookup out for a newer one.

    After a lookup failed or timed out, the next one runs in the background while plan() uses the
    last answer: a store that hangs costs one `store_timeout` per request, not one per step.
    """

    hits: list[bool] | None = None     # the last answer; None until one arrives
    answered: int = -1                 # the step of the last answer (a failed or late lookup answers "none")
    landed: int = -1                   # writes landed when the lookup of `hits` was sent
    failed: bool = False               # the last lookup failed or timed out
    future: Future | None = None       # the lookup out now
    asked_landed: int = -1             # writes landed when `future` was sent
    deadline: float = 0.0


@dataclass
class _Write:
    """A store put or delete running off the step loop. Past its deadline the engine stops waiting."""

    future: Future
    hashes: list[BlockHash]            # the blocks a put writes: forgotten as stored if it fails
    deadline: float


class TierManager:
    """Owns the tiers' pools, every request's block table and every transfer record."""

    def __init__(self, config: CacheConfig, num_device_blocks: int, num_host_blocks: int = 0,
                 store=None, mover: BlockMover | None = None, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic, probe_wait: float = 0.005):
        self.config = config
        self.block_size = config.block_size
        self.device = BlockPool(num_device_blocks, "device")
        self.host = BlockPool(num_host_blocks, "host") if num_host_blocks > 0 else None
        self.store = store
        assert (self.host is None and store is None) or mover is not None, "lower tiers need a BlockMover"
        self.mover = mover
        self.executor = executor or (ThreadPoolExecutor(4, thread_name_prefix="kvstrata-store") if store else None)
        self.clock = clock
        self.probe_wait = probe_wait
        self._step = 0
        self.reservation = DecodeReservation.from_config(config)
        self.stats = CacheStats()
        self._tables: dict[str, RequestBlocks] = {}
        self._loading: dict[str, RequestBlocks] = {}      # the tables whose request waits on a load
        self._probes: dict[str, _Probe] = {}
        self._orphans: list[LoadTransfer] = []
        self._writes: list[_Write] = []
        self._abandoned: list[Future] = []             # writes given up on that still occupy the executor
        # Hashes this engine wrote to the store -> the order their write landed in (inf while pending).
        self._stored: OrderedDict[BlockHash, float] = OrderedDict()
        self._num_landed = 0
        self._computing: dict[BlockHash, int] = {}      # announced block hashes -> how many requests
        self._unpersisted: OrderedDict[BlockHash, tuple[int, ...]] = OrderedDict()   # see persist()

    # ---- queries (pure) -------------------------------------------------------------------------
    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table; read-only, and valid until its blocks next change."""
        return self._tables[request_id].block_ids

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loading

    @property
    def has_transfers(self) -> bool:
        """Loads or writes still running (the engine keeps stepping until they settle)."""
        return bool(self._orphans or self._writes or self._loading)

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
        """Blocks the requests holding blocks may still grow into, at the current ratio."""
        return sum(self.reservation.blocks(rb.request, rb.request.num_computed_tokens,
                                           len(rb.blocks) * self.block_size, self.block_size)
                   for rb in self._tables.values())

    # ---- admission ------------------------------------------------------------------------------
    def on_step(self, nonempty: bool) -> None:
        self._step += 1
        if nonempty:
            self.reservation.on_step()

    def prepare(self, request: Request) -> bool:
        """Make sure plan() sees an answer from the store about this request's blocks.

        A lookup runs on the executor, waited for at most `probe_wait` seconds here: False while it is
        out. An answer older than one step is asked again (blocks reach the store all the time). A
        lookup that failed or ran past `store_timeout` answers "no hits", once, is not asked again
        until the next step but one, and the lookup after it is not waited for.
        """
        if self.store is None or not self.config.enable_prefix_caching:
            return True
        probe = self._probes.get(request.request_id)
        if probe is None or (probe.future is None and probe.answered < self._step - 1):
            limit = self._max_hit_blocks(request)
            local = len(self._match(self.device, request, 0, limit))
            local += len(self._match(self.host, request, local, limit))
            if local >= limit:
                return True                               # nothing left for the store to supply
            probe = self._probes.setdefault(request.request_id, _Probe())
            self._ask(probe, request.block_hashes[:limit])
            if probe.future is not None and not probe.failed:
                wait([probe.future], timeout=self.probe_wait)
        if probe.future is not None:
            self._collect(probe)
        return probe.hits is not None and (probe.future is None or probe.failed)

    def _ask(self, probe: _Probe, hashes: list[BlockHash]) -> None:
        try:
            probe.future = self.executor.submit(self.store.exists, hashes)
            probe.asked_landed = self._num_landed
        except Exception as exc:                          # the executor refused (shut down): no hits
            self._store_error(exc)
            probe.hits, probe.answered, probe.failed = [], self._step, True
            return
        probe.deadline = self.clock() + self.config.store_timeout

    def _collect(self, probe: _Probe) -> None:
        """Take the lookup's answer if it came; past its deadline, give up on it (one timeout)."""
        if probe.future.done():
            try:
                probe.hits, probe.failed = list(probe.future.result()), False
                probe.landed = probe.asked_landed
            except Exception as exc:                      # a failed lookup is no hit
                self._store_error(exc)
                probe.hits, probe.failed = [], True
        elif self.clock() >= probe.deadline:
            self.stats.count(self.stats.store_errors, "timeout")
            probe.hits, probe.failed = [], True
        else:
            return
        probe.future, probe.answered = None, self._step

    def plan(self, request: Request, max_new_tokens: int, whole: bool = False) -> AdmissionPlan | None:
        """Plan admitting `request` with a chunk of at most `max_new_tokens`; None if it does not fit.

        With `whole`, the chunk must reach the end of the request (no chunked prefill). Pure.
        """
        assert request.request_id not in self._tables, f"{request.request_id} already holds blocks"
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
        plan = AdmissionPlan(
            request=request, epoch=self.device.epoch, hit_blocks=hits,
            num_touched_cached=sum(block.state is BlockState.CACHED for block in hits),
            load_host=host, load_store=store,
            num_new_blocks=num_blocks - len(hits) - len(host) - len(store),
            num_new_tokens=num_new_tokens, reserve=self.reserve_for_running() + own_future)
        return plan if self.fits(plan) else None

    def _hits(self, request: Request) -> tuple[list[Block], list[Block], list[BlockHash]]:
        """The request's prefix hit, tier by tier: device blocks, then host blocks, then store hashes."""
        limit = self._max_hit_blocks(request)
        hits = self._match(self.device, request, 0, limit)
        host = self._match(self.host, request, len(hits), limit)
        return hits, host, self._store_hits(request, len(hits) + len(host), limit)

    def _computing_block(self, request: Request, index: int) -> bool:
        return index < self._max_hit_blocks(request) and request.block_hashes[index] in self._computing

    def waits_for_computing(self, request: Request) -> bool:
        """Whether the request's next uncached block is one another request is computing (pure).

        plan() refuses such a request; the scheduler lets others pass it meanwhile.
        """
        return self._computing_block(request, sum(map(len, self._hits(request))))

    def _store_hits(self, request: Request, start: int, stop: int) -> list[BlockHash]:
        """Blocks the store holds: by the last lookup's answer, or because a write of this engine landed
        after that lookup was sent, or is still running (a load queued behind it finds the record, or
        misses and recomputes). A write that landed before the lookup is what the lookup saw."""
        if self.store is None:
            return []
        probe = self._probes.get(request.request_id)
        found = probe.hits if probe is not None and probe.hits else []
        since = probe.landed if probe is not None else -1
        hashes = []
        for index in range(start, stop):
            block_hash = request.block_hashes[index]
            if not ((index < len(found) and found[index]) or self._stored.get(block_hash, -1) > since):
                break
            hashes.append(block_hash)
        return hashes

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
            got = self.device.allocate(len(plan.load_host) + plan.num_new_blocks)
            assert got is not None, "allocation failed after fits() said yes"
            new_blocks, evicted = got
            undo.append(lambda: (self.device.free(reversed(new_blocks)), self.device.unevict(evicted)))
            flight = self.device.start_transfer(len(plan.load_store))
            assert flight is not None, "load targets unavailable after fits() said yes"
            targets, evicted_for_targets = flight
            undo.append(lambda: ([self.device.end_transfer(block, BlockState.FREE) for block in targets],
                                 self.device.unevict(evicted_for_targets)))
            host_targets = new_blocks[:len(plan.load_host)]
            table = plan.hit_blocks + host_targets + targets + new_blocks[len(plan.load_host):]
            first_admission = request.num_cached_tokens < 0
            load = self._admit_loads(plan, targets, first_admission)
            rb = RequestBlocks(request, table, len(plan.hit_blocks), load)
            self._tables[request.request_id] = rb
            if load is not None:
                self._loading[request.request_id] = rb
        except BaseException:
            self._tables.pop(request.request_id, None)
            self._loading.pop(request.request_id, None)
            for step in reversed(undo):
                step()
            raise
        self._probes.pop(request.request_id, None)
        self._offload_evicted(evicted + evicted_for_targets)
        num_host_loaded = len(host_targets) if self._copy_host_hits(plan, host_targets) else 0
        if num_host_loaded < len(host_targets) and rb.load is not None:
            self._abandon_load(rb, "behind_failed_copy")  # its blocks follow blocks that are recomputed
        self._set_registered(rb, rb.num_registered + num_host_loaded)
        self._announce(rb)
        request.num_computed_tokens = len(plan.hit_blocks) * self.block_size + num_host_loaded * self.block_size
        if first_admission:
            self.stats.prompt_tokens += request.num_prompt_tokens
            request.num_cached_tokens = 0
            self._count_hits(request, "device", len(plan.hit_blocks) * self.block_size)
            self._count_hits(request, "host", num_host_loaded * self.block_size)

    def _count_hits(self, request: Request, tier: str, num_tokens: int) -> None:
        """Credit prompt tokens served by `tier` (at the request's first admission only)."""
        num_tokens = min(num_tokens, request.num_prompt_tokens - request.num_cached_tokens)
        request.num_cached_tokens += num_tokens
        self.stats.count(self.stats.hit_tokens, tier, num_tokens)

    def _admit_loads(self, plan: AdmissionPlan, targets: list[Block], first_admission: bool) -> LoadTransfer | None:
        """Record the store load into `targets` and start it. Bookkeeping first: if this raises, the
        caller rolls back and the executor's result is never looked at."""
        if not targets:
            return None
        size, request = self.block_size, plan.request
        first = len(plan.hit_blocks) + len(plan.load_host)
        tokens = [tuple(request.token_ids[(first + i) * size:(first + i + 1) * size]) for i in range(len(targets))]
        started = self.clock()
        future = self.executor.submit(self.store.get, list(plan.load_store))
        return LoadTransfer(request, targets, list(plan.load_store), tokens, future, started,
                            started + self.config.store_timeout, first_admission)

    def _copy_host_hits(self, plan: AdmissionPlan, targets: list[Block]) -> bool:
        """Copy host hits into their device blocks and index them there; whatever happens, unpin the
        host blocks. False if the copy failed: the targets stay ordinary blocks, to be recomputed."""
        if not targets:
            return True
        pairs = [(src.block_id, dst.block_id) for src, dst in zip(plan.load_host, targets)]
        copied = self._copy("host", "device", pairs)
        self.host.free(plan.load_host)                  # unpinned, and now most recently used
        if not copied:
            return False
        for src, dst in zip(plan.load_host, targets):
            self.device.register(dst, src.block_hash, src.token_ids)
        self.stats.count(self.stats.loaded_blocks, "host", len(targets))
        return True

    def _abandon_load(self, rb: RequestBlocks, reason: str) -> None:
        """Give up on the request's store load now: its targets become ordinary blocks of the request.

        The executor's answer, whenever it comes, is never looked at (records are written into
        blocks only when a load settles, on this thread).
        """
        for target in rb.load.targets:
            self.device.end_transfer(target, BlockState.USED)
        rb.load = None
        del self._loading[rb.request.request_id]
        self.stats.count(self.stats.load_failures, reason)

    def _copy(self, src_tier: str, dst_tier: str, pairs: list[tuple[int, int]]) -> bool:
        """Copy blocks between tiers; False (the fault counted) if the copy raised."""
        try:
            self.mover.copy(src_tier, dst_tier, pairs)
        except Exception as exc:
            self._fault("copy", exc)
            return False
        return True

    def _fault(self, operation: str, exc: Exception) -> None:
        self.stats.count(self.stats.faults, operation)
        logger.warning("%s failed; the blocks involved will be recomputed: %r", operation, exc)

    # ---- growth and release ---------------------------------------------------------------------
    def grow(self, request: Request, num_new_tokens: int) -> bool:
        """Give a request holding blocks room for `num_new_tokens` more tokens. All or nothing."""
        rb = self._tables[request.request_id]
        needed = math.ceil((request.num_computed_tokens + num_new_tokens) / self.block_size) - len(rb.blocks)
        if needed <= 0:
            return True
        got = self.device.allocate(needed)
        if got is None:
            return False
        new_blocks, evicted = got
        rb.extend(new_blocks)
        self._announce(rb)
        self._offload_evicted(evicted)
        return True

    def _announce(self, rb: RequestBlocks) -> None:
        """Announce rb's full blocks of known tokens past those announced: it is computing them."""
        stop = min(len(rb.blocks), len(rb.request.block_hashes)) if self.config.enable_prefix_caching else 0
        for index in range(rb.num_announced, stop):
            block_hash = rb.request.block_hashes[index]
            self._computing[block_hash] = self._computing.get(block_hash, 0) + 1
        rb.num_announced = max(rb.num_announced, stop)

    def _set_registered(self, rb: RequestBlocks, num_registered: int) -> None:
        """Blocks up to `num_registered` are indexed now (or never will be): withdraw their announcements."""
        self._withdraw(rb, rb.num_registered, min(num_registered, rb.num_announced))
        rb.num_registered = num_registered
        rb.num_announced = max(rb.num_announced, num_registered)

    def _withdraw(self, rb: RequestBlocks, start: int, stop: int) -> None:
        for index in range(start, stop):
            block_hash = rb.request.block_hashes[index]
            left = self._computing[block_hash] - 1
            if left:
                self._computing[block_hash] = left
            else:
                del self._computing[block_hash]

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks whose every token now has KV, so others can hit them."""
        rb = self._tables[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        if not self.config.enable_prefix_caching:
            self._set_registered(rb, num_full)
            return
        size = self.block_size
        for index in range(rb.num_registered, num_full):
            block = rb.blocks[index]
            tokens = request.token_ids[index * size:(index + 1) * size]
            if self.device.register(block, request.block_hashes[index], tokens):
                if self.config.write_policy == "write_through":
                    self._write_through(block)
                self._remember_unpersisted(block)
        self._set_registered(rb, max(rb.num_registered, num_full))

    def release(self, request: Request) -> None:
        """Return every block the request holds, tail first; a pending load is left to settle on its own."""
        self._probes.pop(request.request_id, None)
        rb = self._tables.pop(request.request_id, None)
        if rb is None:
            return
        self._loading.pop(request.request_id, None)
        self._withdraw(rb, rb.num_registered, rb.num_announced)
        in_flight = set()
        if rb.load is not None:
            rb.load.request = None
            self._orphans.append(rb.load)
            self.stats.orphaned_loads += 1
            in_flight = {id(block) for block in rb.load.targets}
        self.device.free(block for block in reversed(rb.blocks) if id(block) not in in_flight)

    # ---- moving blocks down ---------------------------------------------------------------------
    def _offload_evicted(self, evicted: Sequence[EvictedBlock]) -> None:
        """Write-back: copy device blocks evicted from the cache to host (or straight to the store)."""
        self.stats.count(self.stats.evicted_blocks, "device", len(evicted))
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
        if not self._copy("device", "host", [(item.block_id, slot.block_id) for item, slot in zip(todo, slots)]):
            self.host.free(slots)                       # unhashed: back to FREE; the evicted KV is not kept
            return
        for item, slot in zip(todo, slots):
            self.host.register(slot, item.block_hash, item.token_ids)
        self.host.free(slots)
        self.stats.count(self.stats.offloaded_blocks, "host", len(slots))

    def _write_through(self, block: Block) -> None:
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
        if not self._copy("device", "host", [(block.block_id, slot.block_id)]):
            self.host.free([slot])
            return
        self.host.register(slot, block.block_hash, block.token_ids)
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

        The hash counts as stored from now on, so it is not written twice; a write that fails or
        runs past its deadline is forgotten, so a later eviction of the block writes it again.
        """
        if self.store is None or block_hash in self._stored:
            return
        if not self._has_write_room():
            self.stats.dropped_writes += 1
            return
        try:
            record = self.mover.encode(tier, block_id, block_hash, token_ids)
        except Exception as exc:
            self._fault("encode", exc)
            return
        if not self._submit_write(self.store.put, [(block_hash, record)], [block_hash]):
            return
        self._stored[block_hash] = math.inf
        if len(self._stored) > REMEMBERED_STORED:
            self._stored.popitem(last=False)

    def _submit_write(self, fn: Callable, argument: list, hashes: list[BlockHash]) -> bool:
        try:
            future = self.executor.submit(fn, argument)
        except Exception as exc:                          # the executor refused (shut down)
            self._store_error(exc)
            return False
        self._writes.append(_Write(future, hashes, self.clock() + self.config.store_timeout))
        return True

    def _settle_writes(self) -> None:
        self._writes = [w for w in self._writes if not self._settle_write(w)]
        self._abandoned = [f for f in self._abandoned if not f.done()]

    def _settle_write(self, write: _Write) -> bool:
        """Account a finished (or overdue) write; False while it may still finish in time."""
        if write.future.done():
            try:
                write.future.result()
            except Exception as exc:
                self._store_error(exc)
                self._forget_stored(write.hashes)
                return True
            self.stats.count(self.stats.offloaded_blocks, "store", len(write.hashes))
            for block_hash in write.hashes:
                if block_hash in self._stored:
                    self._num_landed += 1
                    self._stored[block_hash] = self._num_landed
            return True
        if self.clock() < write.deadline:
            return False
        self.stats.count(self.stats.store_errors, "timeout")
        self._forget_stored(write.hashes)
        self._abandoned.append(write.future)
        return True

    def _forget_stored(self, hashes: list[BlockHash]) -> None:
        for block_hash in hashes:
            self._stored.pop(block_hash, None)

    def _store_error(self, exc: Exception) -> None:
        kind = getattr(exc, "kind", type(exc).__name__)
        self.stats.count(self.stats.store_errors, kind)
        logger.warning("store error (%s): %s", kind, exc)

    # ---- persistence ----------------------------------------------------------------------------
    # Write-back sends a block to the store only when host evicts it, so a process that stops
    # before that takes its cache with it. With `persist`, every block that becomes full is
    # remembered, and persist() writes the ones still on device or host to the store; the engine
    # calls it when it has nothing else to do and, with no limit, at close. A block that left both
    # tiers meanwhile went to the store by eviction (or was lost with a dropped write).
    def _remember_unpersisted(self, block: Block) -> None:
        if self.store is None or not self.config.persist or block.block_hash in self._stored:
            return
        self._unpersisted[block.block_hash] = block.token_ids
        if len(self._unpersisted) > MAX_UNPERSISTED:
            self._unpersisted.popitem(last=False)

    @property
    def num_unpersisted(self) -> int:
        """Full blocks not yet written to the store by persist() (some may have left by eviction)."""
        return len(self._unpersisted)

    def persist(self, limit: int | None = None) -> int:
        """Start store writes for up to `limit` remembered blocks, oldest first; how many started.

        Stops early while MAX_PENDING_WRITES writes are out, so nothing is dropped for lack of room:
        the rest waits for the next call.
        """
        started = 0
        while self._unpersisted and (limit is None or started < limit) and self._has_write_room():
            block_hash, token_ids = self._unpersisted.popitem(last=False)
            for tier, pool in (("device", self.device), ("host", self.host)):
                block = pool.lookup(block_hash, token_ids) if pool is not None else None
                if block is not None:
                    self._write_to_store(tier, block.block_id, block_hash, token_ids)
                    started += 1
                    break
        return started

    def _has_write_room(self) -> bool:
        """Whether _write_to_store would take one more write now (rather than drop it)."""
        self._settle_writes()
        return len(self._writes) + len(self._abandoned) < MAX_PENDING_WRITES

    # ---- settling loads -------------------------------------------------------------------------
    def poll_loads(self) -> list[Request]:
        """Settle every load that finished or timed out; return the requests ready to run."""
        ready = []
        for rb in list(self._loading.values()):
            loaded = self._settle(rb.load)
            if loaded is not None:
                rb.load = None
                self._set_registered(rb, rb.num_registered + loaded)
                del self._loading[rb.request.request_id]
                ready.append(rb.request)
        self._orphans = [load for load in self._orphans if self._settle(load) is None]
        self._settle_writes()
        return ready

    def wait_for_transfers(self, timeout: float) -> None:
        """Block until some transfer may have settled (the engine calls this when it has nothing else)."""
        pending = [rb.load.future for rb in self._loading.values()] + [t.future for t in self._orphans]
        pending += [w.future for w in self._writes]
        pending += [p.future for p in self._probes.values() if p.future is not None]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def _settle(self, load: LoadTransfer) -> int | None:
        """Apply a finished load (or give up on a late one); None while it is still running.

        Returns how many leading blocks loaded: those are indexed, the rest become ordinary blocks
        whose tokens the request recomputes. An orphaned load's loaded blocks go to the cache.
        """
        reason = None                                     # one reason per failed load
        if load.future.done():
            try:
                records = load.future.result()
            except Exception as exc:
                self._store_error(exc)
                reason, records = "error", []
        elif self.clock() >= load.deadline:
            reason, records = "timeout", []
        else:
            return None
        loaded = 0
        for target, block_hash, tokens, record in zip(load.targets, load.hashes, load.token_ids, records):
            if record is None:
                reason = "missing"
                break
            try:
                self.mover.decode_into("device", target.block_id, record, block_hash, tokens)
            except Exception as exc:
                reason = getattr(exc, "reason", None)
                if reason is None:                        # not the record's fault: keep it
                    self._fault("decode", exc)
                    reason = "decode"
                    break
                logger.warning("dropping a bad store record (%s): %s", reason, exc)
                self._submit_write(self.store.delete, [block_hash], [])
                self._stored.pop(block_hash, None)
                break
            loaded += 1
        if loaded < len(load.targets):
            self.stats.count(self.stats.load_failures, reason or "missing")
        for index, target in enumerate(load.targets):
            ok = index < loaded
            if load.orphaned:
                self.device.end_transfer(target, BlockState.CACHED if ok else BlockState.FREE,
                                         load.hashes[index], load.token_ids[index])
            else:
                self.device.end_transfer(target, BlockState.USED, load.hashes[index] if ok else None,
                                         load.token_ids[index] if ok else None)
        self.stats.count(self.stats.loaded_blocks, "store", loaded)
        self.stats.load_seconds += self.clock() - load.started
        if not load.orphaned:
            load.request.num_computed_tokens += loaded * self.block_size
            if load.first_admission:
                self._count_hits(load.request, "store", loaded * self.block_size)
        return loaded

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
        for rb in self._tables.values():
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
        for load in self._orphans:
            assert load.orphaned, "an orphaned load still names a request"
            in_flight.extend(block.block_id for block in load.targets)
        assert len(in_flight) == len(set(in_flight)), "a block is the target of two loads"
        assert {rid for rid, rb in self._tables.items() if rb.load} == set(self._loading), "loading index is stale"
        assert announced == self._computing, "announced block hashes disagree with the block tables"
        counts = {"device": self.device.audit(holders, in_flight)}
        if self.host is not None:
            counts["host"] = self.host.audit({})
        return counts

    def snapshot(self, with_order: bool = True) -> tuple:
        return (self.device.snapshot(with_order), self.host.snapshot(with_order) if self.host else None,
                tuple(sorted((rid, tuple(self.block_ids(rid))) for rid in self._tables)))
