"""Routing policies: which engine of a fleet takes a request, decided over engine views.

    round_robin      the next available engine in turn
    least_loaded     the engine with the fewest unfinished requests
    prefix_affinity  the engine this router last sent the longest matching prefix to: what the
                     router remembers, not what the engine still holds (SGLang's router keeps such
                     an approximate tree); the least loaded engine when that one is much busier
    kv_aware         the engine that leaves the least prefill work: prompt tokens missing from its
                     device and host caches plus the prompt tokens already queued there (the llm-d /
                     Dynamo rule)

A policy never sees an engine, only an `EngineView`: what it holds (block hashes per tier) and how
busy it is. `kvstrata simulate` builds views from its in-process schedulers (kvstrata.sim.routing);
`kvstrata router` builds them from the engines' KV events (kvstrata.router.event_view). Both run the very
same policy objects, so a fleet plan made with the simulator is a plan for the real router.

The store tier is shared by the fleet, so it does not tell engines apart: views hold device and
host only. Policies only read views.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstrata.core.hashing import BlockHash

REMEMBERED_PREFIXES = 1 << 20      # prefix_affinity's memory of block hashes, least recently routed dropped
VIEW_TIERS = ("device", "host")     # matched in this order: a device run, then a host run


class EngineView(Protocol):
    """What a policy may know about one engine."""

    @property
    def available(self) -> bool:
        """False while the engine is out (dead, refusing): it gets no new requests."""

    def num_requests(self) -> int:
        """Unfinished requests on the engine (queued or running)."""

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens the engine still has to compute for the requests it holds."""

    def holds(self, tier: str, block_hash: BlockHash) -> bool:
        """Whether the engine's `tier` ("device" or "host") holds the block with this hash."""


@dataclass(frozen=True)
class RoutedPrompt:
    """A prompt as a policy sees it: its length and the chained hashes of its full blocks."""

    num_tokens: int
    block_hashes: Sequence[BlockHash]
    block_size: int

    @property
    def max_hit_blocks(self) -> int:
        """Full blocks a hit may cover: the last token is always computed, for its logits."""
        return min(len(self.block_hashes), max(0, self.num_tokens - 1) // self.block_size)


def cached_tokens(view: EngineView, prompt: RoutedPrompt) -> int:
    """Prompt tokens a hit would cover on this engine: its device prefix, then host blocks after it."""
    matched, limit = 0, prompt.max_hit_blocks
    for tier in VIEW_TIERS:
        while matched < limit and view.holds(tier, prompt.block_hashes[matched]):
            matched += 1
    return matched * prompt.block_size


class NoEngineAvailable(RuntimeError):
    """Every engine of the fleet is out."""


@dataclass(frozen=True)
class Decision:
    engine: int                    # index into the views
    predicted_hit_tokens: int      # prompt tokens the chosen engine's caches should cover


class Policy:
    """Chooses among the available views. Stateful policies remember what they routed."""

    def route(self, prompt: RoutedPrompt, views: Sequence[EngineView]) -> Decision:
        candidates = [index for index, view in enumerate(views) if view.available]
        if not candidates:
            raise NoEngineAvailable("no engine is available")
        chosen = self.choose(prompt, views, candidates)
        assert chosen in candidates, f"policy chose engine {chosen}, which is not available"
        return Decision(chosen, cached_tokens(views[chosen], prompt))

    def choose(self, prompt: RoutedPrompt, views: Sequence[EngineView], candidates: list[int]) -> int:
        raise NotImplementedError


def least_loaded(views: Sequence[EngineView], candidates: list[int]) -> int:
    """The candidate with the fewest requests; the lowest index on a tie."""
    return min(candidates, key=lambda index: (views[index].num_requests(), index))


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._next = 0

    def choose(self, prompt: RoutedPrompt, views: Sequence[EngineView], candidates: list[int]) -> int:
        chosen = next((index for index in candidates if index >= self._next), candidates[0])
        self._next = (chosen + 1) % len(views)
        return chosen


class LeastLoaded(Policy):
    def choose(self, prompt: RoutedPrompt, views: Sequence[EngineView], candidates: list[int]) -> int:
        return least_loaded(views, candidates)


class PrefixAffinity(Policy):
    """Longest prefix this router has sent somewhere, unless that engine is overloaded or out."""

    def __init__(self, stride: int = 1):
        assert stride >= 1
        self.stride = stride                  # remember every stride-th block hash (one per trace block)
        self._owner: OrderedDict[BlockHash, int] = OrderedDict()

    def choose(self, prompt: RoutedPrompt, views: Sequence[EngineView], candidates: list[int]) -> int:
        hashes = prompt.block_hashes[self.stride - 1::self.stride]
        best = None
        for block_hash in hashes:
            owner = self._owner.get(block_hash)
            if owner is None:
                break
            best = owner
        least = least_loaded(views, candidates)
        overloaded = best is not None and views[best].num_requests() > 2 * views[least].num_requests() + 8
        chosen = least if best is None or best not in candidates or overloaded else best
        for block_hash in hashes:
            self._owner[block_hash] = chosen
            self._owner.move_to_end(block_hash)
        while len(self._owner) > REMEMBERED_PREFIXES:
            self._owner.popitem(last=False)
        return chosen


class KVAware(Policy):
    """Fewest prompt tokens to compute: uncached there, plus what is queued there already."""

    def choose(self, prompt: RoutedPrompt, views: Sequence[EngineView], candidates: list[int]) -> int:
        costs = []
        for index in candidates:
            view = views[index]
            uncached = prompt.num_tokens - cached_tokens(view, prompt)
            costs.append((uncached + view.queued_prompt_tokens(), view.num_requests(), index))
        return min(costs)[2]


POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_affinity": PrefixAffinity, "kv_aware": KVAware,
}


def make_policy(name: str, blocks_per_prefix_step: int = 1) -> Policy:
    """`blocks_per_prefix_step`: engine blocks per unit of prefix prefix_affinity remembers (a trace block)."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
    if name == "prefix_affinity":
        return PrefixAffinity(blocks_per_prefix_step)
    return POLICIES[name]()
