"""The simulator's side of routing: engine views read from in-process schedulers, and its `Router`.

`kvstrata simulate` holds its engines' `Scheduler` objects, so its `SchedulerView` (an
`EngineView` of kvstrata.router.policies) reads their pools and request tables directly, and its
`Router` runs a policy over those views for each arriving request. The policies themselves live
in kvstrata.router.policies, the same objects `kvstrata router` runs over views built from KV
events, so a fleet planned here is planned for that router.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.core.hashing import BlockHash
from kvstrata.core.request import Request
from kvstrata.router.policies import POLICIES, Policy, RoutedPrompt, make_policy
from kvstrata.scheduler.scheduler import Scheduler

ROUTERS = POLICIES


@dataclass(frozen=True)
class SchedulerView:
    """An engine's view read from its scheduler and tier manager; always available. The simulator
    routes with it; a server reports its load with it (kvstrata.engine.kv_events)."""

    scheduler: Scheduler
    available: bool = True

    def num_requests(self) -> int:
        return len(self.scheduler.requests)

    def queued_prompt_tokens(self) -> int:
        # list() copies the table in one step under the GIL: the server reads it beside the engine thread.
        requests = list(self.scheduler.requests.values())
        return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in requests)

    def holds(self, tier: str, block_hash: BlockHash) -> bool:
        pool = self.scheduler.tiers.device if tier == "device" else self.scheduler.tiers.host
        return pool is not None and pool.contains(block_hash)


def routed_prompt(request: Request, block_size: int) -> RoutedPrompt:
    return RoutedPrompt(request.num_tokens, request.block_hashes, block_size)


class Router:
    """A policy over the views of a simulated fleet."""

    def __init__(self, policy: Policy, engines: Sequence[Scheduler]):
        assert engines, "a fleet needs an engine"
        self.policy = policy
        self.views = [SchedulerView(engine) for engine in engines]
        self.block_size = engines[0].tiers.block_size

    def route(self, request: Request) -> int:
        return self.policy.route(routed_prompt(request, self.block_size), self.views).engine


def make_router(name: str, engines: Sequence[Scheduler], blocks_per_prefix_step: int = 1) -> Router:
    """`blocks_per_prefix_step`: engine blocks per unit of prefix prefix_affinity remembers (a trace block)."""
    return Router(make_policy(name, blocks_per_prefix_step), engines)
