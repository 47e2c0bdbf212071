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
from kvstrata.kvcache.group_match import GroupHit, GroupMatcher
from kvstrata.kvcache.guarded_mover import GuardedMover
from kvstrata.kvcache.kv_groups import KVGroups
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
    # KV groups 1..: their part of the hit (kvstrata.kvcache.group_match), and their pages for the new blocks and
    # the forks' copies; hits of group 0 some other group could not serve
    extra: GroupHit | None = None
    num_extra_new: int = 0
    num_cut_blocks: int = 0

    @property
    def num_loads(self) -> int:
        """Group 0's blocks to load (every group's, with `num_extra_loads`)."""
        return len(self.load_host) + len(self.load_store)

    @property
    def extra_hits(self) -> list[list[Block | None]]:
        return self.extra.tables if self.extra is not None else []

    @property
    def num_extra_loads(self) -> int:
        return len(self.extra.host) + len(self.extra.store) if self.extra is not None else 0

    @property
    def num_hit_tokens(self) -> int:
        """Tokens whose KV comes from a cache tier (device hits plus loads)."""
        return (len(self.hit_blocks) + self.num_loads) * self.request.hasher.block_size

    @property
    def num_blocks_taken(self) -> int:
        return (self.num_touched_cached + self.num_loads + self.num_new_blocks + self.num_fork_blocks
                + self.num_extra_new + self.num_extra_loads)

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
        self.groups = groups if groups is not None and groups.num_groups > 1 else None
        self.matcher = None if self.groups is None else GroupMatcher(self.groups, config.block_size, device, host,
                                                                     store_io)
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
        if request.device_hits_only:
            return hits, [], []
        host = self._match(self.host, request, len(hits), limit)
        start = len(hits) + len(host)
        store = [] if self.store_io is None else self.store_io.hits(request.request_id, request.block_hashes,
                                                                     start, limit)
        return hits, host, store

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
            if local >= limit and (self.matcher is None
                                   or self.matcher.match(request, limit, host=True, store=False).length == limit):
                return True                               # nothing left for the store to supply
            if self.matcher is not None:                  # every group's pages, in one lookup
                self.store_io.look_up(request.request_id, self.matcher.lookup_keys(request, local, limit), self._step)
            else:                                         # the store continues the device and host's run
                self.store_io.look_up(request.request_id, request.block_hashes[local:limit], self._step)
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
        extra, num_cut = None, 0
        if self.matcher is not None:
            num_cut = len(hits) + len(host) + len(store)
            lower = not request.device_hits_only
            extra = self.matcher.match(request, num_cut, host=lower, store=lower)
            num_cut -= extra.length
            hits, host, store = _cut(extra.length, hits, host, store)
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
            num_touched_cached=sum(block.state is BlockState.CACHED
                                   for block in _pages(hits, extra.tables if extra else [])),
            load_host=host, load_store=store,
            num_new_blocks=num_blocks - len(hits) - len(host) - len(store),
            num_new_tokens=num_new_tokens,
            reserve=self.reserve_for_running() + own_future + sum(map(self._fork_reserve, forks)),
            forks=forks, num_fork_blocks=num_fork_blocks, extra=extra, num_cut_blocks=num_cut,
            num_extra_new=(self.groups.num_groups - 1) * (num_blocks - num_hits + num_fork_blocks) if extra else 0)

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
        self.stats.window_hits += plan.extra is not None and plan.extra.windowed
        plan.request.device_hits_only = False
        num_host_loaded = self._load_host_hits(plan, rb, host_targets)
        if first_admission:
            request, size = plan.request, self.block_size
            self.stats.prompt_tokens += request.num_prompt_tokens
            request.num_cached_tokens = 0
            request.num_shared_blocks = plan.extra.length + plan.num_cut_blocks if plan.extra is not None else 0
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
        extra = plan.extra or GroupHit(0, [])
        undo: list[Callable[[], None]] = []
        try:
            touched = plan.touched
            device.touch(touched)
            undo.append(lambda: device.free(reversed(touched)))
            from_host = plan.load_host + [page for _, _, page in extra.host]
            if from_host:
                self.host.touch(from_host)            # pinned: the offload after the commit must not evict them
                undo.append(lambda: self.host.free(from_host))
            num_group0 = len(plan.load_host) + plan.num_new_blocks + plan.num_fork_blocks
            got = device.allocate(num_group0 + len(extra.host) + plan.num_extra_new)
            assert got is not None, "allocation failed after fits() said yes"
            taken, evicted = got
            undo.append(lambda: (device.free(reversed(taken)), device.unevict(evicted)))
            new_blocks, extra_host, extra_new = _deal(taken, num_group0, len(extra.host))
            flight = device.start_transfer(len(plan.load_store) + len(extra.store))
            assert flight is not None, "load targets unavailable after fits() said yes"
            in_flight, evicted_for_targets = flight
            undo.append(lambda: ([device.end_transfer(block, BlockState.FREE) for block in in_flight],
                                 device.unevict(evicted_for_targets)))
            targets, extra_targets = in_flight[:len(plan.load_store)], in_flight[len(plan.load_store):]
            num_host, num_new = len(plan.load_host), len(new_blocks) - plan.num_fork_blocks
            host_targets = new_blocks[:num_host]
            table = plan.hit_blocks + host_targets + targets + new_blocks[num_host:num_new]
            fresh = _split(extra_new, len(extra.tables), num_new - num_host + plan.num_fork_blocks)
            fork_pages = [page for i, fork in enumerate(new_blocks[num_new:])
                          for page in [fork] + [pages[num_new - num_host + i] for pages in fresh]]
            self.tables.place_forks(plan.forks, fork_pages, 1 + len(fresh))
            tables = [list(hit) for hit in extra.tables]
            for (group, index, _), page in zip(extra.host + extra.store, extra_host + extra_targets):
                tables[group - 1][index] = page
            first = len(plan.hit_blocks) + num_host
            positions = list(range(first, first + len(targets))) + [index for _, index, _ in extra.store]
            load = self.loads.start(request, positions, plan.load_store + [key for _, _, key in extra.store],
                                    targets + extra_targets, first_admission,
                                    len(targets) if plan.extra is not None else None)
            rb = RequestBlocks(request, table, len(plan.hit_blocks), load,
                               extra=[hit + pages[:num_new - num_host] for hit, pages in zip(tables, fresh)])
            self.tables.add(rb)
        except BaseException:
            self.tables.remove(request.request_id)
            for sample in plan.forks:
                self.tables.forks.pop(sample.request_id, None)
            for step in reversed(undo):
                step()
            raise
        return rb, host_targets + extra_host, evicted + evicted_for_targets

    def _load_host_hits(self, plan: AdmissionPlan, rb: RequestBlocks, targets: list[Block]) -> int:
        """Copy host hits into their device pages (every group's: `targets` holds group 0's first), index and
        announce what the request holds, and set how many of its tokens have KV; how many of group 0's host hits
        loaded. A failed copy leaves the targets ordinary blocks to recompute, and abandons a store load queued
        behind them; with KV groups the request starts over instead (`BlockTables.restarts`): a sliding group
        holds no page before its window, so no block before the failed one can be recomputed from."""
        copied = self._copy_host_hits(plan, targets)
        if not copied and rb.load is not None:
            self.loads.abandon(rb, "behind_failed_copy")  # its blocks follow blocks that are recomputed
        if not copied and plan.extra is not None:
            self.tables.restarts[plan.request.request_id] = plan.request
        num_host_loaded = len(plan.load_host) if copied else 0
        self.tables.set_registered(rb, rb.num_registered + num_host_loaded)
        self.tables.announce(rb)
        plan.request.num_computed_tokens = (len(plan.hit_blocks) + num_host_loaded) * self.block_size
        return num_host_loaded

    def _copy_host_hits(self, plan: AdmissionPlan, targets: list[Block]) -> bool:
        """Copy host hits into their device pages and index them there (a group other than 0's unpublished);
        whatever happens, unpin the host pages. False if the copy failed: the targets stay ordinary blocks."""
        if not targets:
            return True
        sources = plan.load_host + ([page for _, _, page in plan.extra.host] if plan.extra is not None else [])
        copied = self.moves.copy("host", "device", [(src.block_id, dst.block_id) for src, dst in zip(sources, targets)])
        self.host.free(sources)                         # unpinned, and now most recently used
        if not copied:
            return False
        for index, (src, dst) in enumerate(zip(sources, targets)):
            self.device.register(dst, src.block_hash, src.token_ids, publish=index < len(plan.load_host))
        self.stats.count(self.stats.loaded_blocks, "host", len(targets))
        self.stats.count(self.stats.group_loads, "host", len(targets) - len(plan.load_host))
        return True


def _pages(hits: list[Block], extra_hits: list[list[Block | None]]) -> list[Block]:
    """Every page of a hit: group 0's blocks, then each other group's (its window's)."""
    return hits + [block for table in extra_hits for block in table if block is not None]


def _cut(length: int, hits: list[Block], host: list[Block], store: list[BlockHash]) -> tuple[list, list, list]:
    """Group 0's hit, device -> host -> store, cut to its first `length` blocks."""
    host = host[:max(0, length - len(hits))]
    return hits[:length], host, store[:max(0, length - len(hits) - len(host))]


def _deal(pages: list[Block], *sizes: int) -> list[list[Block]]:
    """`pages` dealt out in runs of `sizes`, the rest last."""
    runs, at = [], 0
    for size in sizes:
        runs.append(pages[at:at + size])
        at += size
    return [*runs, pages[at:]]


def _split(pages: list[Block], num_groups: int, each: int) -> list[list[Block]]:
    """`pages` dealt out to `num_groups` groups, `each` apiece."""
    assert len(pages) == num_groups * each, "pages for every group"
    return [pages[group * each:(group + 1) * each] for group in range(num_groups)]
