"""`StoreIO`: the tier manager's calls to the store, each off the step loop and each with a deadline.

    lookups   `exists` for the keys of a request's blocks the device and host lack, whose answer plan()
              uses (see `Admission.prepare`)
    loads     `get` of the records a committed plan loads (its LoadTransfer owns the blocks)
    writes    `put` of a block's record, `delete` of a bad one; past the deadline nobody waits
    written   the hashes this engine wrote and the order their writes landed in: nothing is written
              twice, a write that landed after a request's lookup still counts as a hit, and a
              prefill engine knows which of a request's blocks reached the store (`landed_run`)

A call that fails or outlives `timeout` is counted by kind in `CacheStats.store_errors` and answers
"no hits" or "not written"; nothing here raises but `get` (inside commit's transaction, which then
rolls back). Only the tier manager calls it, on the engine thread.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from kvstrata.core.hashing import BlockHash
from kvstrata.core.request import Request
from kvstrata.kvcache.transfers import Executor

logger = logging.getLogger(__name__)

MAX_PENDING_WRITES = 256        # store writes queued (or abandoned and still running) beyond this are dropped
REMEMBERED_STORED = 65536       # hashes known to be in the store, so they are not written twice


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
    # KV groups (kvstrata.kvcache.kv_groups): sliding pages let go as windows moved; hits a sliding group served
    # with its window alone (its earlier pages gone); hits cut short because some group lacked its part
    window_released: int = 0
    window_hits: int = 0
    window_cut_hits: int = 0
    group_loads: dict[str, int] = field(default_factory=lambda: {"host": 0, "store": 0})   # pages of groups 1..
    restarts: int = 0                  # requests given back every page and queued again: a lower tier failed them

    def count(self, table: dict[str, int], key: str, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n

    def count_hits(self, request: Request, tier: str, num_tokens: int) -> None:
        """Credit prompt tokens served by `tier` to the request and here (at its first admission only)."""
        num_tokens = min(num_tokens, request.num_prompt_tokens - request.num_cached_tokens)
        request.num_cached_tokens += num_tokens
        self.count(self.hit_tokens, tier, num_tokens)


@dataclass
class Lookup:
    """Which of a request's block hashes the store holds: the last answer, and a lookup out for a newer one.

    After a lookup failed or timed out, the next one runs in the background while plan() uses the
    last answer: a store that hangs costs one `timeout` per request, not one per step.
    """

    held: set[BlockHash] | None = None   # the last answer: the keys asked that the store holds; None until one
    answered: int = -1                 # the step of the last answer (a failed or late lookup answers "none")
    landed: int = -1                   # writes landed when the lookup of `held` was sent
    failed: bool = False               # the last lookup failed or timed out
    future: Future | None = None       # the lookup out now
    asked: list[BlockHash] = field(default_factory=list)     # the keys `future` asks about
    asked_landed: int = -1             # writes landed when `future` was sent
    deadline: float = 0.0


@dataclass
class _Write:
    """A store put or delete running off the step loop. Past its deadline the engine stops waiting."""

    future: Future
    hashes: list[BlockHash]            # the blocks a put writes: forgotten as stored if it fails
    deadline: float


class StoreIO:
    def __init__(self, store, executor: Executor, clock: Callable[[], float], timeout: float, stats: CacheStats,
                 lookup_wait: float):
        self.store, self.executor, self.clock, self.timeout = store, executor, clock, timeout
        self.stats = stats
        self.lookup_wait = lookup_wait
        self._lookups: dict[str, Lookup] = {}
        self._writes: list[_Write] = []
        self._abandoned: list[Future] = []             # writes given up on that still occupy the executor
        # Hashes this engine wrote to the store -> the order their write landed in (inf while pending).
        self._written: OrderedDict[BlockHash, float] = OrderedDict()
        self._num_landed = 0

    # ---- lookups --------------------------------------------------------------------------------
    def needs_lookup(self, request_id: str, step: int) -> bool:
        """Never asked, or the last answer is older than one step and no lookup is out."""
        lookup = self._lookups.get(request_id)
        return lookup is None or (lookup.future is None and lookup.answered < step - 1)

    def look_up(self, request_id: str, keys: list[BlockHash], step: int) -> None:
        """Send a lookup of `keys` (block hashes, or with KV groups any group's page keys); wait up to
        `lookup_wait` for it unless the last one failed."""
        lookup = self._lookups.setdefault(request_id, Lookup())
        try:
            lookup.future = self.executor.submit(self.store.exists, keys)
            lookup.asked, lookup.asked_landed = keys, self._num_landed
        except Exception as exc:                          # the executor refused (shut down): no hits
            self.error(exc)
            lookup.held, lookup.answered, lookup.failed = set(), step, True
            return
        lookup.deadline = self.clock() + self.timeout
        if not lookup.failed:
            wait([lookup.future], timeout=self.lookup_wait)

    def answered(self, request_id: str, step: int) -> bool:
        """Whether plan() may use the request's lookup: it answered, or the one before it failed.

        A lookup out past its deadline answers "no hits" (one timeout), as of `step`.
        """
        lookup = self._lookups.get(request_id)
        if lookup is None:
            return True
        if lookup.future is not None:
            if lookup.future.done():
                try:
                    found = lookup.future.result()
                    lookup.held = {key for key, held in zip(lookup.asked, found, strict=True) if held}
                    lookup.landed, lookup.failed = lookup.asked_landed, False
                except Exception as exc:                  # a failed lookup is no hit
                    self.error(exc)
                    lookup.held, lookup.failed = set(), True
                lookup.future, lookup.answered = None, step
            elif self.clock() >= lookup.deadline:
                self.stats.count(self.stats.store_errors, "timeout")
                lookup.held, lookup.failed = set(), True
                lookup.future, lookup.answered = None, step
        return lookup.held is not None and (lookup.future is None or lookup.failed)

    def forget_lookup(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)

    def hits(self, request_id: str, hashes: Sequence[BlockHash], start: int, stop: int) -> list[BlockHash]:
        """`hashes[start:stop]`'s leading run the store holds (see `holds`)."""
        run = []
        for block_hash in hashes[start:stop]:
            if not self.holds(request_id, block_hash):
                break
            run.append(block_hash)
        return run

    def holds(self, request_id: str, key: BlockHash) -> bool:
        """Whether the store holds `key` (a block's hash, or a KV group's page key): by the last lookup's answer,
        or because a write of this engine landed after that lookup was sent, or is still running (a load queued
        behind it finds the record, or misses and recomputes). A write that landed before the lookup is what
        the lookup saw, or what it did not ask about (the device or host held it then)."""
        lookup = self._lookups.get(request_id)
        if lookup is None:
            return self._written.get(key, -1) > -1
        return key in (lookup.held or ()) or self._written.get(key, -1) > lookup.landed

    # ---- loads ----------------------------------------------------------------------------------
    def get(self, hashes: list[BlockHash]) -> Future:
        """Fetch records for a load; raises if the executor refuses (commit rolls back)."""
        return self.executor.submit(self.store.get, hashes)

    # ---- writes ---------------------------------------------------------------------------------
    def wrote(self, block_hash: BlockHash) -> bool:
        """This engine wrote the block (or is writing it), as far as it remembers."""
        return block_hash in self._written

    def has_room(self) -> bool:
        """Whether one more write can start now rather than be dropped."""
        self.settle()
        return len(self._writes) + len(self._abandoned) < MAX_PENDING_WRITES

    def put(self, block_hash: BlockHash, record: bytes) -> None:
        """Write a record; the hash counts as written from now on (forgotten if the write fails)."""
        if self._submit(self.store.put, [(block_hash, record)], [block_hash]):
            self._written[block_hash] = math.inf
            if len(self._written) > REMEMBERED_STORED:
                self._written.popitem(last=False)

    def delete(self, block_hash: BlockHash) -> None:
        self._submit(self.store.delete, [block_hash], [])
        self._written.pop(block_hash, None)

    def landed_run(self, hashes: Sequence[BlockHash]) -> tuple[int, bool]:
        """How many of `hashes`, from the first, this engine's writes have put in the store, and whether
        the write of the next one is still out (its landing would make the run longer). A write that
        failed or ran past its deadline ends the run."""
        self.settle()
        for run, block_hash in enumerate(hashes):
            landed = self._written.get(block_hash)
            if landed is None or landed == math.inf:
                return run, landed is not None
        return len(hashes), False

    @property
    def has_writes(self) -> bool:
        return bool(self._writes)

    def pending(self) -> list[Future]:
        """The writes and lookups still out, for the engine to wait on when it has nothing else."""
        return [w.future for w in self._writes] + [p.future for p in self._lookups.values() if p.future is not None]

    def settle(self) -> None:
        """Account every write that finished or ran past its deadline."""
        self._writes = [w for w in self._writes if not self._settle(w)]
        self._abandoned = [f for f in self._abandoned if not f.done()]

    def _submit(self, fn: Callable, argument: list, hashes: list[BlockHash]) -> bool:
        try:
            future = self.executor.submit(fn, argument)
        except Exception as exc:                          # the executor refused (shut down)
            self.error(exc)
            return False
        self._writes.append(_Write(future, hashes, self.clock() + self.timeout))
        return True

    def _settle(self, write: _Write) -> bool:
        """Account a finished (or overdue) write; False while it may still finish in time."""
        if write.future.done():
            try:
                write.future.result()
            except Exception as exc:
                self.error(exc)
                self._forget(write.hashes)
                return True
            self.stats.count(self.stats.offloaded_blocks, "store", len(write.hashes))
            for block_hash in write.hashes:
                if block_hash in self._written:
                    self._num_landed += 1
                    self._written[block_hash] = self._num_landed
            return True
        if self.clock() < write.deadline:
            return False
        self.stats.count(self.stats.store_errors, "timeout")
        self._forget(write.hashes)
        self._abandoned.append(write.future)
        return True

    def _forget(self, hashes: list[BlockHash]) -> None:
        for block_hash in hashes:
            self._written.pop(block_hash, None)

    def error(self, exc: Exception) -> None:
        kind = getattr(exc, "kind", type(exc).__name__)
        self.stats.count(self.stats.store_errors, kind)
        logger.warning("store error (%s): %s", kind, exc)
