"""`TierManager`: every block a request takes, planned before anything is taken.

Admission of a waiting request is two calls:

    plan(request, max_new_tokens)  pure: match the prefix tier by tier, count every block the
                                   request will take, decide whether it fits -> AdmissionPlan | None
    commit(plan)                   take all of it, or (on any exception) none of it

The rule (DESIGN.md §5), with every term counted before anything is taken:

    touched_cached + load_host + load_store + new + reserve  <=  free + cached

    touched_cached  device hits that are CACHED now: taking them removes them from the evictable side
    load_*          lower-tier hits, each needing a device block to load into
    new             blocks for this chunk's uncached tokens
    reserve         decode growth of the requests already holding blocks, plus this request's own
                    future beyond this chunk (see DecodeReservation)

(Equivalently: loads + new + reserve <= free + cached blocks not hit by this plan.)

A plan records the pool epoch it was computed at; `commit` refuses a plan whose epoch is stale,
so nothing can slip in between the decision and the allocation. Running requests grow with
`grow()`, which is all or nothing and keeps no reserve: when it fails, the scheduler preempts.

Only this class calls the pools; the scheduler sees block ids and counts, never blocks.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from kvstrata.config import CacheConfig
from kvstrata.kvcache.block_pool import Block, BlockPool, BlockState, PoolCounts
from kvstrata.kvcache.hashing import BlockHash
from kvstrata.request import Request

logger = logging.getLogger(__name__)


@dataclass
class AdmissionPlan:
    """Everything one admission will take. Computed by `plan()`, consumed once by `commit()`."""

    request: Request
    epoch: int
    hit_blocks: list[Block]            # device prefix hit, in order
    num_touched_cached: int            # hits that are CACHED now
    load_host: list[Block]             # host blocks to load into fresh device blocks (tiers issue)
    load_store: list[BlockHash]        # store records to load into fresh device blocks (tiers issue)
    num_new_blocks: int                # blocks for this chunk's uncached tokens
    num_new_tokens: int                # tokens computed in this step
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
    plus `ratio` times the tokens it may still sample (clipped). The ratio starts at `init`, decays by
    `decay` per non-empty step to `floor`, and jumps back to `init` after a preemption: a
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
    """A request's device block table and how many of its blocks are in the hash index."""

    request: Request
    blocks: list[Block]
    num_registered: int = 0


@dataclass
class CacheStats:
    """Counters since start, read by metrics and benchmarks."""

    prompt_tokens: int = 0
    hit_tokens_device: int = 0
    evicted_blocks_device: int = 0


class TierManager:
    """Owns the tiers' pools and every request's block table."""

    def __init__(self, config: CacheConfig, num_device_blocks: int):
        self.config = config
        self.block_size = config.block_size
        self.device = BlockPool(num_device_blocks, "device")
        self.reservation = DecodeReservation.from_config(config)
        self.stats = CacheStats()
        self._tables: dict[str, RequestBlocks] = {}

    # ---- queries (pure) -------------------------------------------------------------------------
    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._tables[request_id].blocks]

    def match_device(self, request: Request) -> list[Block]:
        """The longest run of the request's full blocks on device, leaving the last token to compute."""
        if not self.config.enable_prefix_caching:
            return []
        size = self.block_size
        hits = []
        for index in range((request.num_tokens - 1) // size):
            block = self.device.lookup(request.block_hashes[index],
                                       request.token_ids[index * size:(index + 1) * size])
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix_tokens(self, request: Request) -> int:
        return len(self.match_device(request)) * self.block_size

    def reserve_for_running(self) -> int:
        """Blocks the requests holding blocks may still grow into, at the current ratio."""
        return sum(self.reservation.blocks(rb.request, rb.request.num_computed_tokens,
                                           len(rb.blocks) * self.block_size, self.block_size)
                   for rb in self._tables.values())

    def plan(self, request: Request, max_new_tokens: int, whole: bool = False) -> AdmissionPlan | None:
        """Plan admitting `request` with a chunk of at most `max_new_tokens`; None if it does not fit.

        With `whole`, the chunk must reach the end of the request (no chunked prefill). Pure.
        """
        assert request.request_id not in self._tables, f"{request.request_id} already holds blocks"
        size = self.block_size
        hits = self.match_device(request)
        num_hit_tokens = len(hits) * size
        num_new_tokens = min(request.num_tokens - num_hit_tokens, max_new_tokens)
        if num_new_tokens <= 0 or (whole and num_hit_tokens + num_new_tokens < request.num_tokens):
            return None
        num_blocks = math.ceil((num_hit_tokens + num_new_tokens) / size)
        own_future = self.reservation.blocks(request, num_hit_tokens + num_new_tokens, num_blocks * size, size)
        plan = AdmissionPlan(
            request=request, epoch=self.device.epoch, hit_blocks=hits,
            num_touched_cached=sum(block.state is BlockState.CACHED for block in hits),
            load_host=[], load_store=[], num_new_blocks=num_blocks - len(hits),
            num_new_tokens=num_new_tokens, reserve=self.reserve_for_running() + own_future)
        return plan if self.fits(plan) else None

    def fits(self, plan: AdmissionPlan) -> bool:
        return plan.num_blocks_needed <= self.device.num_available

    # ---- mutations ------------------------------------------------------------------------------
    def commit(self, plan: AdmissionPlan) -> None:
        """Take every block of the plan as one transaction: on any exception, undo all and re-raise."""
        request = plan.request
        if plan.epoch != self.device.epoch:
            raise RuntimeError(f"stale plan for {request.request_id}: the pool changed since it was made")
        if not self.fits(plan):
            raise RuntimeError(f"plan for {request.request_id} does not fit; plan() would have refused it")
        undo = []
        try:
            self.device.touch(plan.hit_blocks)
            undo.append(lambda: self.device.free(reversed(plan.hit_blocks)))
            got = self.device.allocate(plan.num_new_blocks + plan.num_loads)
            assert got is not None, "allocation failed after fits() said yes"
            new_blocks, evicted = got
            undo.append(lambda: (self.device.free(reversed(new_blocks)), self.device.unevict(evicted)))
            self._admit_loads(plan, new_blocks[:plan.num_loads])
            self._tables[request.request_id] = RequestBlocks(request, plan.hit_blocks + new_blocks,
                                                             num_registered=len(plan.hit_blocks))
        except BaseException:
            for step in reversed(undo):
                step()
            raise
        self.stats.evicted_blocks_device += len(evicted)
        num_hit = len(plan.hit_blocks) * self.block_size
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = min(num_hit, request.num_prompt_tokens)
            self.stats.prompt_tokens += request.num_prompt_tokens
            self.stats.hit_tokens_device += request.num_cached_tokens

    def _admit_loads(self, plan: AdmissionPlan, targets: list[Block]) -> None:
        """Start the lower-tier loads of a plan into `targets`. The device-only manager has none."""
        assert not targets, "the device-only tier manager cannot load from lower tiers"

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
        rb.blocks.extend(new_blocks)
        self.stats.evicted_blocks_device += len(evicted)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks whose every token now has KV, so others can hit them."""
        rb = self._tables[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        if not self.config.enable_prefix_caching:
            rb.num_registered = num_full
            return
        size = self.block_size
        for index in range(rb.num_registered, num_full):
            self.device.register(rb.blocks[index], request.block_hashes[index],
                                 request.token_ids[index * size:(index + 1) * size])
        rb.num_registered = max(rb.num_registered, num_full)

    def release(self, request: Request) -> None:
        """Return every block the request holds, tail first. A no-op for a request holding none."""
        rb = self._tables.pop(request.request_id, None)
        if rb is not None:
            self.device.free(reversed(rb.blocks))

    # ---- audit ----------------------------------------------------------------------------------
    def counts(self) -> dict[str, PoolCounts]:
        return {"device": self.device.counts()}

    def audit(self) -> dict[str, PoolCounts]:
        """Check every pool against the block tables; raise AuditError naming the bad blocks."""
        holders: dict[int, int] = {}
        for rb in self._tables.values():
            assert not rb.request.is_finished, f"finished request {rb.request.request_id} still holds blocks"
            for block in rb.blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        return {"device": self.device.audit(holders)}

    def snapshot(self, with_order: bool = True) -> tuple:
        return (self.device.snapshot(with_order),
                tuple(sorted((rid, tuple(self.block_ids(rid))) for rid in self._tables)))
