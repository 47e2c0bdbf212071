"""The simulator's stand-ins for KV bytes and store I/O, on a virtual clock.

The real `TierManager` runs unchanged on top of them:
- `NullMover` copies nothing between device and host; it adds up what the copies would cost, and
  the step that made them pays for it (the engine copies inside the step too). Encoding a store
  record (a write) and decoding one (a load landing) also run in the engine's step loop: they
  accrue the profile's per-record time the same way.
- `SimStore` is the store tier: which block hashes it holds, least recently used deleted first.
  Its records are the block hashes themselves. One instance serves a whole fleet.
- `VirtualExecutor` runs each store call when its transfer would have ended, so store lookups
  and loads take virtual time and requests sit in LOADING, blocks IN_FLIGHT, as in the engine.
  A call leaves when the engine thread gets to it, after the copies and encodes of its step so far.
  A lookup the engine would have waited for (it ends within `PROBE_WAIT_S`) is answered at once
  and its wait accrues to the step, as the engine's plan() waits for it in the step: otherwise
  every request that looks up the store lost a step to the simulator (what that changed against
  the engine: docs/design/simulator.md, "The stand-ins").
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from kvstrata.core.hashing import BlockHash
from kvstrata.sim.cost_model import Link

logger = logging.getLogger(__name__)


class VirtualClock:
    """Seconds since the start of the simulation; only the event loop moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class NullMover:
    """A `BlockMover` that moves no bytes: device <-> host copies accrue `link` time for the step,
    each record encoded `record_seconds`, each decoded `decode_seconds` (None: the same)."""

    def __init__(self, link: Link, block_bytes: int, record_seconds: float = 0.0, decode_seconds: float | None = None):
        self.link = link
        self.block_bytes = block_bytes
        self.record_seconds = record_seconds
        self.decode_seconds = record_seconds if decode_seconds is None else decode_seconds
        self._seconds = 0.0

    def copy(self, src_tier: str, dst_tier: str, pairs: Sequence[tuple[int, int]]) -> None:
        self._seconds += self.link.seconds(len(pairs) * self.block_bytes)

    def encode(self, tier: str, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bytes:
        self._seconds += self.record_seconds
        return block_hash

    def decode_into(self, tier: str, block_id: int, record: bytes, block_hash: BlockHash,
                    token_ids: Sequence[int]) -> None:
        self._seconds += self.decode_seconds
        if record != block_hash:
            raise BadRecord("hash")

    @property
    def accrued(self) -> float:
        """Copy and record time accrued since the last `take_seconds`: the engine thread's time so far
        in the step being scheduled."""
        return self._seconds

    def take_seconds(self) -> float:
        """Copy time accrued since the last call."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds


class BadRecord(ValueError):
    def __init__(self, reason: str):
        super().__init__(f"store record failed its {reason} check")
        self.reason = reason


class SimStore:
    """The store tier: block hashes it holds, least recently read or written deleted first."""

    def __init__(self, capacity_blocks: int | None = None):
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError("a store holds at least one block (or is unbounded)")
        self.capacity_blocks = capacity_blocks
        self.evictions = 0
        self._records: OrderedDict[BlockHash, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def exists(self, keys: Sequence[BlockHash]) -> list[bool]:
        return [key in self._records for key in keys]

    def get(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        out = []
        for key in keys:
            record = self._records.get(key)
            if record is not None:
                self._records.move_to_end(key)
            out.append(record)
        return out

    def put(self, items: Sequence[tuple[BlockHash, bytes]]) -> None:
        for key, record in items:
            self._records[key] = record
            self._records.move_to_end(key)
        while self.capacity_blocks is not None and len(self._records) > self.capacity_blocks:
            self._records.popitem(last=False)
            self.evictions += 1

    def delete(self, keys: Sequence[BlockHash]) -> None:
        for key in keys:
            self._records.pop(key, None)

    def close(self) -> None:
        """Nothing to release: the records live in this object."""


Post = Callable[[float, Callable[[], None]], None]


class VirtualExecutor:
    """Store calls on the virtual clock: each runs, and its Future completes, when its transfer ends.

    Calls share one link, first come first served: a call's bytes wait for the bytes before it,
    its latency overlaps them. `get` and `put` move a block per key; `exists` and `delete` cost
    latency only. `post(time, callback)` hands the completion to the event loop. An `exists` (a
    lookup) that ends within `lookup_wait` completes before `submit` returns, its wait noted for
    `take_waited`.

    A call is sent when the engine thread gets to it: after the copies and record encodes
    `busy()` says the step being scheduled has made so far, and the lookups it waited for. The
    engine's schedule() does that work between one admission's store load and the next (a host
    hit copied, evictions offloaded and encoded): the second of two loads admitted in one step
    leaves after the first, and the step that started them finds both landed; sent at one instant,
    the simulator's found the first alone (docs/design/simulator.md, "The stand-ins").
    """

    def __init__(self, clock: VirtualClock, link: Link, block_bytes: int, post: Post, lookup_wait: float = 0.0,
                 busy: Callable[[], float] = lambda: 0.0):
        self.clock = clock
        self.link = link
        self.block_bytes = block_bytes
        self.post = post
        self.lookup_wait = lookup_wait
        self.busy = busy
        self._link_free_at = 0.0
        self._waited = 0.0

    def submit(self, fn: Callable, /, *args) -> Future:
        name = getattr(fn, "__name__", "")
        nbytes = self.block_bytes * len(args[0]) if name in ("get", "put") else 0
        sent = self.clock.now + self.busy() + self._waited
        start = max(sent, self._link_free_at)
        self._link_free_at = start + nbytes / self.link.bandwidth
        end = start + self.link.seconds(nbytes)
        future: Future = Future()
        if name == "exists" and end <= sent + self.lookup_wait:
            self._waited += end - sent
            _complete(future, fn, args)
        else:
            self.post(end, lambda: _complete(future, fn, args))
        return future

    def take_waited(self) -> float:
        """Seconds the engine waited for lookups since the last call (they delay its step)."""
        waited, self._waited = self._waited, 0.0
        return waited


def _complete(future: Future, fn: Callable, args: tuple) -> None:
    try:
        result = fn(*args)
    except Exception as exc:       # the tier manager reads store failures from the Future, as in the engine
        future.set_exception(exc)
    else:
        future.set_result(result)
