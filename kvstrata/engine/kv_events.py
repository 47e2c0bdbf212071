"""KV events: what an engine's caches hold, published for routers (`GET /v1/kv_events`).

Every hash that joins or leaves the device or host index is an event with a sequence number (the
wire format: kvstrata.core.kv_events). A router long-polls `?since=SEQ` and gets the events after
SEQ, plus the engine's load. Memory is bounded: the log keeps the last `capacity` events; a router
that asks for events already dropped (or names no instance, or another one: it starts, or the
engine restarted) gets a snapshot of every hash held now instead.

    engine thread:  BlockPool.listener -> KVEventRecorder (a plain list, no lock)
                    once per step: KVEventLog.publish(batch, load)      (one lock)
    server thread:  KVEventLog.since(seq) -> events | snapshot          (the same lock)

The server never touches a pool: it reads only what the engine thread published.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvstrata.core.config import ServerConfig
from kvstrata.core.hashing import BlockHash
from kvstrata.core.kv_events import PUBLISHED_TIERS
from kvstrata.kvcache.block_pool import BlockPool

EVENT_LOG_CAPACITY = ServerConfig().kv_events_kept   # `--kv-events-kept`: for routers behind; older: a snapshot
MAX_EVENTS_PER_REPLY = 4096       # a router that is further behind polls again
POLL_INTERVAL = 0.02              # seconds between looks while a long-poll waits

KVEvent = tuple[str, bool, BlockHash]     # (tier, stored, hash)


@dataclass(frozen=True)
class EngineLoad:
    num_requests: int
    queued_prompt_tokens: int


class KVEventRecorder:
    """The engine thread's side: hears its pools' index changes and hands them over once per step."""

    def __init__(self, pools: Iterable[tuple[str, BlockPool | None]]):
        self.held: dict[str, list[BlockHash]] = {}
        self._pending: list[KVEvent] = []
        for tier, pool in pools:
            if pool is None:
                continue
            assert tier in PUBLISHED_TIERS and pool.listener is None, f"{tier} pool already published"
            self.held[tier] = list(pool.hashes())
            pool.listener = lambda block_hash, stored, tier=tier: self._pending.append((tier, stored, block_hash))

    def take(self) -> list[KVEvent]:
        """The events since the last call."""
        events, self._pending = self._pending, []
        return events


class KVEventLog:
    """A ring of (seq, tier, stored, hash) events and the set of hashes each tier holds now."""

    def __init__(self, block_size: int, hash_root: BlockHash, held: dict[str, list[BlockHash]],
                 capacity: int = EVENT_LOG_CAPACITY):
        assert capacity >= 1
        self.block_size, self.hash_root = block_size, hash_root
        self.instance = uuid.uuid4().hex        # a new engine process starts a new sequence
        self._lock = threading.Lock()
        self._events: deque[tuple[int, str, bool, BlockHash]] = deque(maxlen=capacity)
        self._held: dict[str, set[BlockHash]] = {tier: set(held.get(tier, ())) for tier in PUBLISHED_TIERS}
        self._load = EngineLoad(0, 0)
        self.seq = 0
        # LoRA adapter name -> the hex root of its requests' block hashes (swapped whole by the engine
        # thread when adapters change), so a router hashes an adapter's prompts as the engine does
        self.adapter_roots: Mapping[str, str] = {}

    @property
    def capacity(self) -> int:
        return self._events.maxlen or 0

    def __len__(self) -> int:
        return len(self._events)

    def publish(self, events: list[KVEvent], load: EngineLoad) -> None:
        """The engine thread's batch of one step, and its load after the step."""
        with self._lock:
            self._load = load
            for tier, stored, block_hash in events:
                self.seq += 1
                self._events.append((self.seq, tier, stored, block_hash))
                if stored:
                    self._held[tier].add(block_hash)
                else:
                    self._held[tier].discard(block_hash)

    def since(self, seq: int, instance: str | None = None) -> dict:
        """The reply to `?since=seq&instance=I`: events after seq, or a snapshot when those are not
        all kept, or when `instance` is not this log's (a router starting, or a restarted engine)."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self.seq + 1
            reply: dict = {"instance": self.instance, "block_size": self.block_size,
                           "hash_root": self.hash_root.hex(), "adapter_roots": dict(self.adapter_roots),
                           "snapshot": None, "events": [],
                           "load": {"num_requests": self._load.num_requests,
                                    "queued_prompt_tokens": self._load.queued_prompt_tokens}}
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
