"""Routers: which engine of a fleet takes a request.

    round_robin      the next engine in turn
    least_loaded     the engine with the fewest unfinished requests
    prefix_affinity  the engine this router last sent the longest matching prefix to: what the
                     router remembers, not what the engine still holds (SGLang's router keeps such
                     an approximate tree); the least loaded engine when that one is much busier
    kv_aware         the engine that leaves the least prefill work: prompt tokens missing from its
                     device and host caches plus the prompt tokens already queued there (the llm-d /
                     Dynamo rule), read from the engines' real block pools

The store tier is shared, so it does not tell engines apart. Routers only read engine state.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from kvstrata.kvcache.hashing import BlockHash
from kvstrata.request import Request
from kvstrata.scheduler import Scheduler

logger = logging.getLogger(__name__)

REMEMBERED_PREFIXES = 1 << 20      # prefix_affinity's memory of block hashes, least recently routed dropped


class Router:
    def __init__(self, engines: Sequence[Scheduler]):
        self.engines = engines

    def route(self, request: Request) -> int:
        raise NotImplementedError

    def _least_loaded(self) -> int:
        loads = [len(engine.requests) for engine in self.engines]
        return loads.index(min(loads))


class RoundRobin(Router):
    def __init__(self, engines: Sequence[Scheduler]):
        super().__init__(engines)
        self._next = 0

    def route(self, request: Request) -> int:
        chosen, self._next = self._next, (self._next + 1) % len(self.engines)
        return chosen


class LeastLoaded(Router):
    def route(self, request: Request) -> int:
        return self._least_loaded()


class PrefixAffinity(Router):
    """Longest prefix this router has sent somewhere, unless that engine is overloaded."""

    def __init__(self, engines: Sequence[Scheduler], stride: int = 1):
        super().__init__(engines)
        self.stride = stride                  # remember every stride-th block hash (one per trace block)
        self._owner: OrderedDict[BlockHash, int] = OrderedDict()

    def route(self, request: Request) -> int:
        hashes = request.block_hashes[self.stride - 1::self.stride]
        best = None
        for block_hash in hashes:
            owner = self._owner.get(block_hash)
            if owner is None:
                break
            best = owner
        least = self._least_loaded()
        loads = [len(engine.requests) for engine in self.engines]
        chosen = least if best is None or loads[best] > 2 * loads[least] + 8 else best
        for block_hash in hashes:
            self._owner[block_hash] = chosen
            self._owner.move_to_end(block_hash)
        while len(self._owner) > REMEMBERED_PREFIXES:
            self._owner.popitem(last=False)
        return chosen


class KVAware(Router):
    """Fewest prompt tokens to compute: uncached here, plus what is queued here already."""

    def route(self, request: Request) -> int:
        costs = []
        for index, engine in enumerate(self.engines):
            uncached = request.num_prompt_tokens - self._cached_tokens(engine, request)
            queued = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in engine.requests.values())
            costs.append((uncached + queued, len(engine.requests), index))
        return min(costs)[2]

    @staticmethod
    def _cached_tokens(engine: Scheduler, request: Request) -> int:
        """Prompt tokens a hit would cover on this engine's device, then host, tier."""
        tiers, size = engine.tiers, engine.tiers.block_size
        matched = tiers.cached_prefix_tokens(request) // size
        limit = (request.num_tokens - 1) // size
        if tiers.host is not None:
            while matched < limit and tiers.host.contains(request.block_hashes[matched]):
                matched += 1
        return matched * size


ROUTERS: dict[str, type[Router]] = {
    "round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_affinity": PrefixAffinity, "kv_aware": KVAware,
}


def make_router(name: str, engines: Sequence[Scheduler], blocks_per_prefix_step: int = 1) -> Router:
    """`blocks_per_prefix_step`: engine blocks per unit of prefix prefix_affinity remembers (a trace block)."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
    if name == "prefix_affinity":
        return PrefixAffinity(engines, blocks_per_prefix_step)
    return ROUTERS[name](engines)
