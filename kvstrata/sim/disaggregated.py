"""`kvstrata simulate --prefill-instances P --decode-instances D`: the handoff of
docs/design/disaggregation.md on the virtual clock, with the real scheduler and tier manager.

    arrival    the request goes to a prefill engine (`--router` over the prefill engines), with one
               token to sample; prefill engines write blocks through to the shared store
    handoff    when it ends, `TierManager.hand_off` writes its prompt blocks not yet written, and once
               `stored_run` has no write left out (the store's transfer times, from the profile), the
               request goes to a decode engine (prefix_affinity over the decode engines, as the
               router picks them) with its whole output to sample
    decode     the decode engine's lookup finds the stored blocks, loads them (LOADING, the store
               link's time) and computes the rest of the prompt, then decodes

With `local_prefill_tokens` (the router's --local-prefill-tokens), a request whose decode engine lacks
at most that many of its prompt tokens goes there at arrival and is prefilled there: no handoff.

A request's TTFT is its decode engine's first token, as a client of `kvstrata router
--pd-disaggregation` sees it (the prefill engine's token is not sent on), and so are its ITL. Hit
rates are the prefill engines' (prefix caching); the decode engines' store hits are the handoff (and
their device hits, not counted in the hit rate, the requests they prefilled themselves).
"""

from __future__ import annotations

import dataclasses

from kvstrata.core.config import CacheConfig, SchedulerConfig
from kvstrata.core.hashing import BlockHash
from kvstrata.core.request import Request
from kvstrata.sim.config import SimConfig
from kvstrata.sim.cost_model import CostModel
from kvstrata.sim.results import SimResult
from kvstrata.sim.routing import make_router
from kvstrata.sim.simulator import Simulator, _Engine
from kvstrata.sim.traces import TraceRequest


class DisaggregatedSimulator(Simulator):
    """Engines 0..P-1 prefill, P..P+D-1 decode; one store shared by all."""

    def __init__(self, trace: list[TraceRequest], config: SimConfig, cost: CostModel, prefill_instances: int,
                 decode_instances: int, progress=None):
        if prefill_instances < 1 or decode_instances < 1:
            raise ValueError("a disaggregated fleet needs at least one prefill and one decode instance")
        if config.store_cache_tokens == 0:
            raise ValueError("prefill and decode instances hand KV over through the store: give "
                             "--store-cache-tokens (a size, or inf)")
        self.num_prefill = prefill_instances
        super().__init__(trace, dataclasses.replace(config, instances=prefill_instances + decode_instances),
                         cost, progress)
        schedulers = [engine.scheduler for engine in self.engines]
        self.router = make_router(self.config.router, schedulers[:prefill_instances], self.tokens.per_trace_block)
        self.decode_router = make_router("prefix_affinity", schedulers[prefill_instances:], self.tokens.per_trace_block)
        self._handoffs: dict[int, list[tuple[int, list[BlockHash]]]] = {}    # prefill engine -> (request, hashes)

    def _engine(self, index: int, cache: CacheConfig, scheduling: SchedulerConfig) -> _Engine:
        if index < self.num_prefill:        # as --disaggregation-mode prefill sets it
            cache = dataclasses.replace(cache, write_policy="write_through")
        return super()._engine(index, cache, scheduling)

    def _arrive(self, index: int) -> None:
        if self.config.local_prefill_tokens and self._prefill_locally(index):
            return
        request = self._new_request(index, 1)
        engine = self.engines[self.router.route(request) if self.num_prefill > 1 else 0]
        engine.scheduler.add_request(request)
        self._wake(engine, self.clock.now)

    def _prefill_locally(self, index: int) -> bool:
        """Send the request to its decode engine if that one lacks at most local_prefill_tokens of its prompt."""
        request = self._new_request(index, self.trace[index].output_length)
        decode = self.engines[self.num_prefill + self.decode_router.route(request)]
        if request.num_prompt_tokens - decode.tiers.cached_prefix_tokens(request) > self.config.local_prefill_tokens:
            return False
        self.records[index].engine = decode.index
        decode.scheduler.add_request(request)
        self._wake(decode, self.clock.now)
        return True

    def _finish(self, engine: _Engine, request: Request) -> None:
        if engine.index >= self.num_prefill:
            super()._finish(engine, request)
            return
        self._handoffs.setdefault(engine.index, []).append((int(request.request_id), engine.tiers.hand_off(request)))
        self._hand_over(engine)

    def _on_io(self, job) -> None:
        super()._on_io(job)
        index = job[0]
        if index < self.num_prefill and self._handoffs.get(index):
            self._hand_over(self.engines[index])

    def _result(self, ideal: float, wall_s: float) -> SimResult:
        return dataclasses.replace(super()._result(ideal, wall_s), prompt_engines=self.num_prefill)

    def _hand_over(self, engine: _Engine) -> None:
        """Send each request whose stored run is settled to a decode engine."""
        waiting = []
        for index, hashes in self._handoffs.get(engine.index, []):
            if engine.tiers.stored_run(hashes)[1]:
                waiting.append((index, hashes))
                continue
            request = self._new_request(index, self.trace[index].output_length)
            decode = self.engines[self.num_prefill + self.decode_router.route(request)]
            self.records[index].engine = decode.index
            decode.scheduler.add_request(request)
            self._wake(decode, self.clock.now)
        self._handoffs[engine.index] = waiting
