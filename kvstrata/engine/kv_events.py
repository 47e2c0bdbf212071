"""KV events: what an engine's caches hold, published for routers (`GET /v1/kv_events`).

Every hash that joins or leaves the device or host index is an event with a sequence number. A
router long-polls `?since=SEQ` and gets the events after SEQ, plus the engine's load (requests
held, prompt tokens still to compute). Memory is bounded: the log keeps the last `capacity`
events; a router that asks for events already dropped (or names no instance, or another one: it
starts, or the engine restarted) gets a snapshot of every hash held now instead.

    engine thread:  BlockPool.listener -> KVEventLog.record   (under a lock, O(1))
    server thread:  KVEventLog.since(seq) -> events | snapshot

Hashes are the chained block hashes of kvstrata.core.hashing, sent as hex with the chain root
and block size, so a router computes the same hashes from the tokens and matches without sharing
memory. The store tier is shared by the fleet and is not published.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.core.hashing import BlockHash
from kvstrata.kvcache.block_pool import BlockPool
from kvstrata.scheduler.scheduler import Scheduler
from kvstrata.sim.routing import SchedulerView

PUBLISHED_TIERS = ("device", "host")
EVENT_LOG_CAPACITY = 1 << 16      # events kept for routers that fall behind; older ones: a snapshot
MAX_EVENTS_PER_REPLY = 4096       # a router that is further behind polls again
POLL_INTERVAL = 0.02              # seconds between looks while a long-poll waits


@dataclass(frozen=True)
class EngineLoad:
    num_requests: int
    queued_prompt_tokens: int


class KVEventLog:
    """A ring of (seq, tier, stored, hash) events and the set of hashes each tier holds now."""

    def __init__(self, block_size: int, hash_root: BlockHash, load: Callable[[], EngineLoad],
                 capacity: int = EVENT_LOG_CAPACITY):
        assert capacity >= 1
        self.block_size, self.hash_root, self.load = block_size, hash_root, load
        self.instance = uuid.uuid4().hex        # a new engine process starts a new sequence
        self._lock = threading.Lock()
        self._events: deque[tuple[int, str, bool, BlockHash]] = deque(maxlen=capacity)
        self._held: dict[str, set[BlockHash]] = {tier: set() for tier in PUBLISHED_TIERS}
        self.seq = 0

    def attach(self, tier: str, pool: BlockPool | None) -> None:
        """Publish `pool`'s index changes as `tier` events, starting from what it holds now.

        Call before the engine thread touches the pool (at server start-up).
        """
        if pool is None:
            return
        assert tier in PUBLISHED_TIERS and pool.listener is None, f"{tier} pool already published"
        with self._lock:
            self._held[tier].update(pool.hashes())
        pool.listener = lambda block_hash, stored: self.record(tier, block_hash, stored)

    def record(self, tier: str, block_hash: BlockHash, stored: bool) -> None:
        with self._lock:
            self.seq += 1
            self._events.append((self.seq, tier, stored, block_hash))
            if stored:
                self._held[tier].add(block_hash)
            else:
                self._held[tier].discard(block_hash)

    def since(self, seq: int, instance: str | None = None) -> dict:
        """The reply to `?since=seq&instance=I`: events after seq, or a snapshot when those are not
        all kept, or when `instance` is not this log's (a router starting, or a restarted engine)."""
        load = self.load()
        with self._lock:
            oldest = self._events[0][0] if self._events else self.seq + 1
            reply: dict = {"instance": self.instance, "block_size": self.block_size,
                           "hash_root": self.hash_root.hex(), "snapshot": None, "events": [],
                           "load": {"num_requests": load.num_requests,
                                    "queued_prompt_tokens": load.queued_prompt_tokens}}
            if instance != self.instance or seq < 0 or seq > self.seq or seq + 1 < oldest:
                reply["snapshot"] = {tier: [h.hex() for h in held] for tier, held in self._held.items()}
                reply["seq"] = self.seq
                return reply
            start = seq + 1 - oldest          # the ring holds consecutive sequence numbers
            events = list(itertools.islice(self._events, start, start + MAX_EVENTS_PER_REPLY))
            reply["events"] = [[s, tier, int(stored), h.hex()] for s, tier, stored, h in events]
            reply["seq"] = events[-1][0] if events else seq
            return reply

    async def poll(self, seq: int, instance: str | None, timeout: float) -> dict:
        """`since`, but wait up to `timeout` seconds for something new: an event or a change of load."""
        deadline = time.monotonic() + timeout
        reply = self.since(seq, instance)
        load = reply["load"]
        while (reply["snapshot"] is None and not reply["events"] and reply["load"] == load
               and time.monotonic() < deadline):
            await asyncio.sleep(POLL_INTERVAL)
            reply = self.since(seq, instance)
        return reply


def publish(scheduler: Scheduler, hash_root: BlockHash, capacity: int = EVENT_LOG_CAPACITY) -> KVEventLog:
    """The event log of an engine's device and host pools, with its load; call before its thread
    serves requests. `hash_root`: the root of the engine's block hash chain (model, cache salt)."""
    view = SchedulerView(scheduler)
    log = KVEventLog(scheduler.tiers.block_size, hash_root,
                     lambda: EngineLoad(view.num_requests(), view.queued_prompt_tokens()), capacity)
    log.attach("device", scheduler.tiers.device)
    log.attach("host", scheduler.tiers.host)
    return log
