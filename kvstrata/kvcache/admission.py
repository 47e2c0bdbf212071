"""Admission of a waiting request: `plan` matches its prefix tier by tier and counts every block it
will take (pure), `commit` takes all of it as one transaction. The rule plan decides by is in
`tiers.py`'s docstring (DESIGN.md §5); `DecodeReservation` is its `reserve` term.

The transaction and its undo are side by side in `Admission._take`: each step that takes something
pushes the step that gives it back, and any exception runs them in reverse. What follows the
transaction (offloading what it evicted, copying host hits) is compensated: it never raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstrata.core.config import CacheConfig
from kvstrata.core.hashing import BlockHash
from kvstrata.core.request import Request, RequestStatus
from kvstrata.kvcache.block_pool import Block, BlockPool, BlockState, EvictedBlock
from kvstrata.kvcache.block_tables import BlockTables, PendingFork, RequestBlocks
from kvstrata.kvcache.guarded_mover import GuardedMover
from kvstrata.kvcache.kv_groups import KVGroups, group_hash
from kvstrata.kvcache.loads import StoreLoads
from kvstrata.kvcache.store_io import CacheStats, StoreIO
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
    extra_hits: list[list[Block | None]] = field(default_factory=list)   # KV groups 1..: their tables' hit part
    num_extra_new: int = 0             # KV groups 1..: pages for the new blocks, and the forks' copies
    num_cut_blocks: int = 0            # device hits of group 0 some other group could not serve

    @property
    def num_loads(self) -> int:
        return len(self.load_host) + len(self.load_store)

    @property
    def num_hit_tokens(self) -> int:
        """Tokens whose KV comes from a cache tier (device hits plus loads)."""
        return (len(self.hit_blocks) + self.num_loads) * self.request.hasher.block_size

    @property
    def num_blocks_taken(self) -> int:
        return (self.num_touched_cached + self.num_loads + self.num_new_blocks + self.num_fork_blocks
                + self.num_extra_new)

    @property
    def touched(self) -> list[Block]:
        """Every page of the hit, group 0's first."""
        return _pages(self.hit_blocks, self.extra_hits)

    @property
    def num_blocks_needed(self) -> int:
        return self.num_blocks_taken + self.reserve


@dataclass
class DecodeReservation:
    """Blocks kept free at admission for running requests to grow into.

    A request's future KV is its pending tokens (the rest of its prompt, the token just sampled)
    plus `ratio` times the tokens it may still sample (clipped), plus, for a request that speculates,
    the slots of one step's drafts (`num_lookahead_tokens`), never more than it may still sample.
    The ratio starts at `init`, decays
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
        future = pending + min(decode_left, request.num_lookahead_tokens + math.ceil(decode_left * self.ratio))
        return max(0, math.ceil((future - (num_slots - num_tokens_with_kv)) / block_size))


class Admission:
    """Plans and commits admissions, and counts the steps that store lookups age by."""

    def __init__(self, config: CacheConfig, *, device: BlockPool, host: BlockPool | None,
                 store_io: StoreIO | None, tables: BlockTables, reservation: DecodeReservation,
                 loads: StoreLoads, write_back: WriteBack, moves: GuardedMover | None, stats: CacheStats,
                 groups: KVGroups | None = None, max_chunk_tokens: int | None = None):
        assert groups is None or (host is None and store_io is None), "KV groups keep no lower tier yet"
        self.groups = groups if groups is not None and groups.num_groups > 1 else None
        self.max_chunk_tokens = max_chunk_tokens      # the most tokens of a request one step computes (None: all)
        self.config = config
        self.block_size = config.block_size
        self.device = device
        self.host = host
        self.store_io = store_io
        self.tables = tables
        self.reservation = reservation
        self.loads = loads
        self.write_back = write_back
        self.moves = moves
        self.stats = stats
        self._step = 0

    def on_step(self, nonempty: bool) -> None:
        self._step += 1
        if nonempty:
            self.reservation.on_step()

    # ---- matching a prefix, tier by tier (pure) -------------------------------------------------
    def _max_hit_blocks(self, request: Request) -> int:
        """Full blocks a hit may cover: the last token is always computed, for its logits; none for a
        request that scores its prompt, whose every position's logits are needed."""
        if not self.config.enable_prefix_caching or request.wants_prompt_logprobs:
            return 0
        return (request.num_tokens - 1) // self.block_size

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

    def _hits(self, request: Request) -> tuple[list[Block], list[Block], list[BlockHash]]:
        """The request's prefix hit, tier by tier: device blocks, then host blocks, then store hashes."""
        limit = self._max_hit_blocks(request)
        hits = self._match(self.device, request, 0, limit)
        host = self._match(self.host, request, len(hits), limit)
        start = len(hits) + len(host)
        store = [] if self.store_io is None else self.store_io.hits(request.request_id, request.block_hashes,
                                                                     start, limit)
        return hits, host, store

    def _group_hits(self, request: Request, hits: list[Block]) -> tuple[list[Block], list[list[Block | None]]]:
        """The longest part of group 0's device hit every other group serves too: a global group every block
        of it, a sliding group the blocks its window reads from the first uncached token on (the pages before
        may be gone). Group 0's hit cut to it, and each other group's table for it (None before its window)."""
        size, groups = self.block_size, self.groups
        found: dict[tuple[int, int], Block | None] = {}       # each page looked up once, however far L steps down

        def page(group: int, index: int) -> Block | None:
            if (group, index) not in found:
                found[group, index] = self.device.lookup(group_hash(request.block_hashes[index], group),
                                                         request.token_ids[index * size:(index + 1) * size])
            return found[group, index]

        for length in range(len(hits), -1, -1):
            tables = []
            for group in range(1, groups.num_groups):
                first = groups.first_needed(group, length * size, size)
                table: list[Block | None] = [None] * first
                for index in range(first, length):
                    block = page(group, index)
                    if block is None:
                        break
                    table.append(block)
                if len(table) < length:
                    break
                tables.append(table)
            else:
                return hits[:length], tables
        raise AssertionError("a hit of no block is always served")

    def _computing_block(self, request: Request, index: int) -> bool:
        return index < self._max_hit_blocks(request) and request.block_hashes[index] in self.tables.computing

    def waits_for_computing(self, request: Request) -> bool:
        """Whether the request's next uncached block is one another request is computing (pure).

        plan() refuses such a request; the scheduler lets others pass it meanwhile.
        """
        return self._computing_block(request, sum(map(len, self._hits(request))))

    # ---- plan -----------------------------------------------------------------------------------
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

    def reserve_for_running(self) -> int:
        """Blocks the requests holding blocks (and the samples waiting to fork) may still grow into."""
        return sum(self._future(rb.request, rb.request.num_computed_tokens, len(rb.blocks))
                   for rb in self.tables.by_request.values()) + sum(map(self._fork_reserve, self.tables.forks.values()))

    def _fork_reserve(self, pending: PendingFork | Request) -> int:
        """A sample's decode growth beyond the last prompt block it will hold after the fork."""
        request = pending.request if isinstance(pending, PendingFork) else pending
        return self._future(request, request.num_prompt_tokens, math.ceil(request.num_prompt_tokens / self.block_size))

    def _future(self, request: Request, num_tokens_with_kv: int, num_blocks: int, held_from: int | None = None) -> int:
        """Pages `request` may still grow into, holding `num_blocks` blocks with `num_tokens_with_kv` tokens of KV:
        the reservation's blocks in every global group; in a sliding group no more than its peak (the window
        and the next computation: a chunk of the rest of the prompt, or a decode and its drafts) beyond the pages
        it holds, those from the window of position `held_from` on (default: the tokens with KV; at admission,
        the first token the chunk computes: the chunk holds its pages until the step is done)."""
        size = self.block_size
        blocks = self.reservation.blocks(request, num_tokens_with_kv, num_blocks * size, size)
        if self.groups is None:
            return blocks
        total, groups = blocks, self.groups
        at_once = max(min(request.num_tokens - num_tokens_with_kv, self.max_chunk_tokens or request.num_tokens),
                      1 + request.num_lookahead_tokens)
        for group in range(1, groups.num_groups):
            kept = num_blocks - groups.first_needed(group, num_tokens_with_kv if held_from is None else held_from, size)
            total += min(blocks, max(0, groups.peak_blocks(group, num_blocks + blocks, at_once, size) - kept))
        return total

    def plan(self, request: Request, max_new_tokens: int, whole: bool = False) -> AdmissionPlan | None:
        """Plan admitting `request` with a chunk of at most `max_new_tokens`; None if it does not fit.

        With `whole`, the chunk must reach the end of the request (no chunked prefill). Pure.
        """
        plan = self.draft(request, max_new_tokens, whole)
        return plan if plan is not None and self.fits(plan) else None

    def draft(self, request: Request, max_new_tokens: int, whole: bool = False) -> AdmissionPlan | None:
        """The plan as plan() counts it, before the verdict of `fits`; None if the request must wait
        for a block another request is computing, or the chunk would compute nothing (or, with
        `whole`, stop short of the end). Pure."""
        assert request.request_id not in self.tables.by_request, f"{request.request_id} already holds blocks"
        size = self.block_size
        hits, host, store = self._hits(request)
        extra_hits: list[list[Block | None]] = []
        num_cut = 0
        if self.groups is not None:
            num_cut = len(hits)
            hits, extra_hits = self._group_hits(request, hits)
            num_cut -= len(hits)
        num_hits = len(hits) + len(host) + len(store)
        if self._computing_block(request, num_hits):
            return None                                   # another request is computing it: wait, then hit
        num_hit_tokens = num_hits * size
        num_new_tokens = min(request.num_tokens - num_hit_tokens, max_new_tokens)
        if num_new_tokens <= 0 or (whole and num_hit_tokens + num_new_tokens < request.num_tokens):
            return None
        num_blocks = math.ceil((num_hit_tokens + num_new_tokens) / size)
        own_future = self._future(request, num_hit_tokens + num_new_tokens, num_blocks, num_hit_tokens)
        forks = request.family.pending if request.family is not None else []
        assert not any(f.request_id in self.tables.forks for f in forks), "a family's samples are already placed"
        partial_last_block = request.num_prompt_tokens % size != 0
        num_fork_blocks = len(forks) if partial_last_block else 0
        return AdmissionPlan(
            request=request, epoch=self.device.epoch, hit_blocks=hits,
            num_touched_cached=sum(block.state is BlockState.CACHED for block in _pages(hits, extra_hits)),
            load_host=host, load_store=store,
            num_new_blocks=num_blocks - len(hits) - len(host) - len(store),
            num_new_tokens=num_new_tokens,
            reserve=self.reserve_for_running() + own_future + sum(map(self._fork_reserve, forks)),
            forks=forks, num_fork_blocks=num_fork_blocks, extra_hits=extra_hits,
            num_extra_new=len(extra_hits) * (num_blocks - len(hits) + num_fork_blocks), num_cut_blocks=num_cut)

    def fits(self, plan: AdmissionPlan) -> bool:
        return plan.num_blocks_needed <= self.device.num_available

    # ---- commit ---------------------------------------------------------------------------------
    def commit(self, plan: AdmissionPlan) -> None:
        """Take every block of the plan as one transaction: on any exception, undo all and re-raise.

        Then come the compensated steps, which never raise (a failure costs recomputation only):
        offload what the allocation evicted, and copy host hits to device.
        """
        self._check(plan)
        first_admission = plan.request.num_cached_tokens < 0
        rb, host_targets, evicted = self._take(plan, first_admission)
        if self.store_io is not None:
            self.store_io.forget_lookup(plan.request.request_id)
        self.write_back.offload_evicted(evicted)
        self.stats.window_cut_hits += plan.num_cut_blocks > 0
        self.stats.window_hits += any(table and table[0] is None for table in plan.extra_hits)
        num_host_loaded = self._load_host_hits(plan, rb, host_targets)
        if first_admission:
            request, size = plan.request, self.block_size
            self.stats.prompt_tokens += request.num_prompt_tokens
            request.num_cached_tokens = 0
            self.stats.count_hits(request, "device", len(plan.hit_blocks) * size)
            self.stats.count_hits(request, "host", num_host_loaded * size)

    def _check(self, plan: AdmissionPlan) -> None:
        """Refuse a plan that plan() would not make now: stale, for a request not waiting, or refused."""
        request = plan.request
        if plan.epoch != self.device.epoch:
            raise RuntimeError(f"stale plan for {request.request_id}: the pool changed since it was made")
        if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            raise RuntimeError(f"plan for {request.request_id}: the request is {request.status.name}, not waiting")
        if not self.fits(plan) or plan.num_new_tokens < 1:
            raise RuntimeError(f"plan for {request.request_id} does not fit or computes nothing; "
                               "plan() would have refused it")

    def _take(self, plan: AdmissionPlan,
              first_admission: bool) -> tuple[RequestBlocks, list[Block], list[EvictedBlock]]:
        """The transaction: every block of the plan taken and the request's table recorded, or (on
        any exception) nothing. Returns the table, the device blocks host hits go to, and what was evicted."""
        request, device = plan.request, self.device
        undo: list[Callable[[], None]] = []
        try:
            touched = plan.touched
            device.touch(touched)
            undo.append(lambda: device.free(reversed(touched)))
            if plan.load_host:
                self.host.touch(plan.load_host)       # pinned: the offload after the commit must not evict them
                undo.append(lambda: self.host.free(plan.load_host))
            num_group0 = len(plan.load_host) + plan.num_new_blocks + plan.num_fork_blocks
            got = device.allocate(num_group0 + plan.num_extra_new)
            assert got is not None, "allocation failed after fits() said yes"
            new_blocks, evicted = got
            new_blocks, extra_new = new_blocks[:num_group0], new_blocks[num_group0:]
            undo.append(lambda: (device.free(reversed(new_blocks + extra_new)), device.unevict(evicted)))
            flight = device.start_transfer(len(plan.load_store))
            assert flight is not None, "load targets unavailable after fits() said yes"
            targets, evicted_for_targets = flight
            undo.append(lambda: ([device.end_transfer(block, BlockState.FREE) for block in targets],
                                 device.unevict(evicted_for_targets)))
            num_host, num_new = len(plan.load_host), len(new_blocks) - plan.num_fork_blocks
            host_targets = new_blocks[:num_host]
            table = plan.hit_blocks + host_targets + targets + new_blocks[num_host:num_new]
            extra = _split(extra_new, len(plan.extra_hits), num_new - num_host + plan.num_fork_blocks)
            fork_pages = [page for i, fork in enumerate(new_blocks[num_new:])
                          for page in [fork] + [pages[num_new - num_host + i] for pages in extra]]
            self.tables.place_forks(plan.forks, fork_pages, 1 + len(extra))
            load = self.loads.start(request, len(plan.hit_blocks) + num_host, plan.load_store, targets,
                                    first_admission)
            rb = RequestBlocks(request, table, len(plan.hit_blocks), load,
                               extra=[hit + pages[:num_new - num_host] for hit, pages in zip(plan.extra_hits, extra)])
            self.tables.add(rb)
        except BaseException:
            self.tables.remove(request.request_id)
            for sample in plan.forks:
                self.tables.forks.pop(sample.request_id, None)
            for step in reversed(undo):
                step()
            raise
        return rb, host_targets, evicted + evicted_for_targets

    def _load_host_hits(self, plan: AdmissionPlan, rb: RequestBlocks, targets: list[Block]) -> int:
        """Copy host hits into their device blocks, index and announce what the request holds, and
        set how many of its tokens have KV; how many host hits loaded. A failed copy leaves the
        targets ordinary blocks to recompute, and abandons a store load queued behind them."""
        num_host_loaded = len(targets) if self._copy_host_hits(plan, targets) else 0
        if num_host_loaded < len(targets) and rb.load is not None:
            self.loads.abandon(rb, "behind_failed_copy")  # its blocks follow blocks that are recomputed
        self.tables.set_registered(rb, rb.num_registered + num_host_loaded)
        self.tables.announce(rb)
        plan.request.num_computed_tokens = (len(plan.hit_blocks) + num_host_loaded) * self.block_size
        return num_host_loaded

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


def _pages(hits: list[Block], extra_hits: list[list[Block | None]]) -> list[Block]:
    """Every page of a hit: group 0's blocks, then each other group's (its window's)."""
    return hits + [block for table in extra_hits for block in table if block is not None]


def _split(pages: list[Block], num_groups: int, each: int) -> list[list[Block]]:
    """`pages` dealt out to `num_groups` groups, `each` apiece."""
    assert len(pages) == num_groups * each, "pages for every group"
    return [pages[group * each:(group + 1) * each] for group in range(num_groups)]
