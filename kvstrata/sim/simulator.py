"""`kvstrata simulate`: a trace replayed through the real Scheduler and TierManager on a virtual clock.

One discrete-event loop, no sleeping, no torch; the code that schedules and caches is the code
that serves requests:

    arrival    build the Request (token ids and block hashes from the trace ids), route it to an
               engine, add it to that engine's Scheduler
    step       an idle engine with work calls schedule(); the step lasts what the cost model
               charges for its batch plus its device <-> host copies and the store lookups
               schedule() waited for (stand_ins.VirtualExecutor); when it ends, update() gets
               one sampled token per sampling chunk (requests stop at their trace output length)
               and the next step starts at once; with speculation, a decode may carry drafts,
               and how many of them were accepted is drawn from the workload's acceptance
               (kvstrata.sim.speculation); a step that computes nothing but copied or
               encoded blocks (an admission that only started loads) lasts that work, as the
               engine's schedule() does; with `max_tpot_ms` (the engine's --max-tpot-ms),
               each engine learns its step cost from its simulated steps and cuts prefill
               beside decodes as the engine does (kvstrata.scheduler.step_cost)
    store I/O  lookups, loads and writes complete when their transfer would have (stand_ins), so
               requests wait in LOADING and blocks stay IN_FLIGHT as in the engine

At equal times arrivals go first, then store I/O, then steps: a burst of arrivals meets the next
step together. A fleet is K engines on the same clock sharing one store.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.core.config import CacheConfig, SchedulerConfig
from kvstrata.core.hashing import BlockHasher
from kvstrata.core.request import AdapterRef, Request
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.kvcache.kv_groups import kv_groups_for
from kvstrata.kvcache.tiers import PROBE_WAIT_S, TierManager
from kvstrata.scheduler.output import SchedulerOutput
from kvstrata.scheduler.scheduler import Scheduler
from kvstrata.scheduler.step_cost import StepCostModel
from kvstrata.sim.batch_shape import BatchShape
from kvstrata.sim.config import SimConfig
from kvstrata.sim.cost_model import CostModel
from kvstrata.sim.results import RequestRecord, SimResult
from kvstrata.sim.routing import make_router
from kvstrata.sim.speculation import SimulatedDrafts
from kvstrata.sim.stand_ins import NullMover, SimStore, VirtualClock, VirtualExecutor
from kvstrata.sim.traces import TraceRequest, TraceTokens, ideal_hit_rate, num_prompt_blocks

logger = logging.getLogger(__name__)

SIM_FINGERPRINT = "kvstrata-simulator"   # the hash root of simulated blocks
SAMPLED_TOKEN = 0                        # what every simulated step samples (requests ignore EOS)
ARRIVAL, IO, STEP = 0, 1, 2              # event order at equal times


@dataclass
class _Engine:
    """One simulated engine: the real scheduler and tier manager, and its place on the clock."""

    index: int
    scheduler: Scheduler
    tiers: TierManager
    mover: NullMover
    executor: VirtualExecutor
    step_cost: StepCostModel                   # what its steps cost, learned as the engine learns it
    output: SchedulerOutput | None = None      # the step in progress, applied when it ends
    wake_at: float | None = None               # a pending wake-up of an idle engine
    steps: int = 0
    step_cpu_s: float = 0.0                    # the profile's seconds of its steps (before shared cores stretch
                                               # them): the CPU time its engine thread would use
    started: float = 0.0                       # when the step in progress started
    work_s: float = 0.0                        # shared cores: its CPU seconds not yet done
    rate: float = 1.0                          # shared cores: the share of a core it gets since `since`
    since: float = 0.0
    step_seq: int = 0                          # numbers its end-of-step events: an earlier one is stale


class Simulator:
    """Replays `trace` once: `run()` returns the figures. `progress(done, total)` hears each finish."""

    def __init__(self, trace: list[TraceRequest], config: SimConfig, cost: CostModel,
                 progress: Callable[[int, int], None] | None = None):
        self.trace, self.config, self.cost = trace, config.validate(), cost
        self.progress = progress
        size = config.block_size
        self.tokens = TraceTokens(BlockHasher.create(size, SIM_FINGERPRINT), config.tokens_per_id)
        self.clock = VirtualClock()
        self._events: list[tuple] = []          # (time, kind, seq, function, argument)
        self._seq = itertools.count()
        self.records = [RequestRecord(r.arrival, r.input_length, r.output_length) for r in trace]
        self._finished = 0
        self._audited = 0
        self._last_token = [math.nan] * len(trace)  # when each request last sampled (for ITL)
        self._itl = array("d")
        max_len = max(r.input_length + r.output_length for r in trace)
        need = max(math.ceil((r.input_length + r.output_length - 1) / size) for r in trace)
        everything = sum(math.ceil((r.input_length + r.output_length) / size) for r in trace)
        device = everything if config.device_cache_tokens is None else config.device_cache_tokens // size
        if device < need:
            raise ValueError(f"the longest request needs {need * size} tokens of device cache but it holds "
                             f"{device * size}; raise --device-cache-tokens or cap --max-input-tokens")
        host = everything if config.host_cache_tokens is None else config.host_cache_tokens // size
        store_blocks = None if config.store_cache_tokens is None else config.store_cache_tokens // size
        # A hybrid model's KV groups: each tier holds pages (a block of one group's layers), num_groups a block's
        # bytes; the capacities above are in tokens of every layer, as the engine's memory flags are.
        self.mix = cost.mix
        self.groups = kv_groups_for(cost.layer_windows, swa_full=config.swa_full) if cost.layer_windows else None
        self.pages = pages = 1 if self.groups is None else self.groups.num_groups
        device, host = device * pages, host * pages
        store_blocks = None if store_blocks is None else store_blocks * pages
        spec = config.speculative
        self.drafts = SimulatedDrafts(config.draft_acceptance, SAMPLED_TOKEN) if spec is not None else None
        self.lookahead = spec.num_speculative_tokens if spec is not None else 0
        self.store = SimStore(store_blocks) if store_blocks != 0 else None
        cache = CacheConfig(block_size=size, num_device_blocks=device, num_host_blocks=host,
                            store="none" if self.store is None else "disk", write_policy=config.write_policy,
                            store_timeout=config.store_timeout)
        cache.validate()
        scheduling = SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                     max_num_batched_tokens=config.max_num_batched_tokens,
                                     max_model_len=max(max_len, 2), policy=config.policy,
                                     max_tpot_ms=config.max_tpot_ms)
        scheduling.validate()
        self.engines = [self._engine(index, cache, scheduling) for index in range(config.instances)]
        self.router = make_router(config.router, [e.scheduler for e in self.engines], self.tokens.per_trace_block)

    def _engine(self, index: int, cache: CacheConfig, scheduling: SchedulerConfig) -> _Engine:
        pages = self.pages
        block_bytes = self.cost.block_bytes(cache.block_size, pages)
        mover = NullMover(self.cost.host_link, block_bytes, self.cost.record_seconds(cache.block_size, pages=pages),
                          self.cost.record_seconds(cache.block_size, decode=True, pages=pages))

        def post_io(at: float, callback: Callable[[], None]) -> None:
            self._post(at, IO, self._on_io, (index, callback))

        executor = VirtualExecutor(self.clock, self.cost.store_link, block_bytes, post_io, PROBE_WAIT_S,
                                   busy=lambda: mover.accrued)
        tiers = TierManager(cache, cache.num_device_blocks, cache.num_host_blocks, store=self.store, mover=mover,
                            executor=executor, clock=self.clock, probe_wait=0,     # the executor answers in time
                            groups=self.groups, max_chunk_tokens=scheduling.max_num_batched_tokens)
        scheduler = Scheduler(scheduling, tiers, speculative=self.config.speculative, proposer=self.drafts)
        return _Engine(index, scheduler, tiers, mover, executor, StepCostModel())

    # ---- the event loop -------------------------------------------------------------------------
    def run(self) -> SimResult:
        started = time.perf_counter()
        ideal = ideal_hit_rate(self.trace, self.tokens)     # also fills the hash cache the arrivals read
        events, trace, clock, arrivals = self._events, self.trace, self.clock, 0
        next_arrival = trace[0].arrival
        while True:
            if events and events[0][0] < next_arrival:
                clock.now, _, _, function, argument = heapq.heappop(events)
                function(argument)
            elif arrivals < len(trace):
                clock.now = next_arrival
                self._arrive(arrivals)
                arrivals += 1
                next_arrival = trace[arrivals].arrival if arrivals < len(trace) else math.inf
            else:
                break
        if self._finished < len(trace):
            raise RuntimeError(f"the simulation stalled with {len(trace) - self._finished} requests unfinished "
                               "and nothing left to happen")
        return self._result(ideal, time.perf_counter() - started)

    def _post(self, at: float, kind: int, function: Callable, argument=None) -> None:
        heapq.heappush(self._events, (at, kind, next(self._seq), function, argument))

    def _new_request(self, index: int, max_tokens: int) -> Request:
        """Trace request `index` as an engine's Request (its id is the index: the records' key)."""
        entry = self.trace[index]
        return Request(str(index), self.tokens.prompt(entry), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       self.tokens.hasher_for(entry), arrival_time=entry.arrival,
                       block_hashes=self.tokens.block_hashes(entry), num_lookahead_tokens=self.lookahead,
                       adapter=AdapterRef(entry.adapter, entry.adapter) if entry.adapter else None)

    def _arrive(self, index: int) -> None:
        request = self._new_request(index, self.trace[index].output_length)
        engine = self.engines[self.router.route(request) if len(self.engines) > 1 else 0]
        self.records[index].engine = engine.index
        engine.scheduler.add_request(request)
        self._wake(engine, self.clock.now)

    def _on_io(self, job: tuple[int, Callable[[], None]]) -> None:
        index, callback = job
        callback()
        engine = self.engines[index]
        if engine.scheduler.has_work:
            self._wake(engine, self.clock.now)

    def _wake(self, engine: _Engine, at: float) -> None:
        """Have an idle engine call schedule() at `at` (a busy one schedules when its step ends)."""
        if engine.output is not None or (engine.wake_at is not None and engine.wake_at <= at):
            return
        engine.wake_at = at
        self._post(at, STEP, self._on_wake, engine)

    def _on_wake(self, engine: _Engine) -> None:
        if engine.output is None and engine.wake_at == self.clock.now:      # else superseded by an earlier wake
            engine.wake_at = None
            self._start_step(engine)

    def _start_step(self, engine: _Engine) -> None:
        output = engine.scheduler.schedule(engine.step_cost.limiter(engine.scheduler.config))
        seconds = engine.mover.take_seconds() + engine.executor.take_waited()
        if output.is_empty and not seconds:
            if engine.tiers.has_transfers:          # come back by the time any pending transfer times out
                self._wake(engine, self.clock.now + self.config.store_timeout)
            return
        engine.output = output                      # a step that only started loads still took its copies' time
        if not output.is_empty:
            seconds += self.cost.step_seconds(BatchShape.of(output.chunks, self.config.block_size,
                                                            self.cost.decode_in_place, self.mix))
        engine.step_cpu_s += seconds
        engine.started = engine.since = self.clock.now
        engine.work_s = seconds
        if self.config.host_cores is None:
            self._end_at(engine, self.clock.now + seconds)
        else:
            self._share_cores()

    def _share_cores(self) -> None:
        """Processor sharing of the cores the fleet shares (`host_cores`): while more engines are in a step
        than the cores hold, each with its `serving_overhead` of serving work beside its thread, every step
        runs at cores / demand of a core's speed; called whenever an engine starts or ends a step, it moves
        each running step's end to where its remaining work at the new share puts it."""
        now, running = self.clock.now, [engine for engine in self.engines if engine.output is not None]
        demand = len(running) * (1.0 + self.config.serving_overhead)
        rate = min(1.0, self.config.host_cores / demand) if running else 1.0
        for engine in running:
            engine.work_s = max(0.0, engine.work_s - (now - engine.since) * engine.rate)
            engine.rate, engine.since = rate, now
            self._end_at(engine, now + engine.work_s / rate)

    def _end_at(self, engine: _Engine, at: float) -> None:
        engine.step_seq += 1
        self._post(at, STEP, self._end_step, (engine, engine.step_seq))

    def _end_step(self, event: tuple[_Engine, int]) -> None:
        engine, seq = event
        if seq != engine.step_seq:                  # moved by processor sharing
            return
        output, engine.output = engine.output, None
        now, records = self.clock.now, self.records
        if not output.is_empty:                     # what the step took, as the engine times its own
            engine.step_cost.observe_step(output, now - engine.started)
        sampled, accepted = {}, {}
        for chunk in output.chunks:
            if chunk.sample:
                request = chunk.request
                sampled[request.request_id] = SAMPLED_TOKEN
                index = int(request.request_id)
                if request.num_output_tokens == 0:
                    records[index].first_token = now
                else:
                    self._itl.append(now - self._last_token[index])
                self._last_token[index] = now
                if chunk.draft_token_ids:
                    accepted[request.request_id] = self.drafts.verify(len(chunk.draft_token_ids))
        for request in engine.scheduler.update(output, sampled, accepted):
            self._finish(engine, request)
        engine.steps += bool(output.chunks)
        if self.config.audit:
            engine.scheduler.audit()
            self._audited += 1
        self._start_step(engine)
        if engine.output is None and self.config.host_cores is not None:     # idle now: the others get its share
            self._share_cores()

    def _finish(self, engine: _Engine, request: Request) -> None:
        record = self.records[int(request.request_id)]
        record.finish, record.cached_tokens = self.clock.now, request.num_cached_tokens
        record.preemptions = request.num_preemptions
        self._finished += 1
        if self.progress is not None:
            self.progress(self._finished, len(self.records))

    # ---- results --------------------------------------------------------------------------------
    def _result(self, ideal: float, wall_s: float) -> SimResult:
        engines = []
        for engine in self.engines:
            stats = engine.tiers.stats
            engines.append({"index": engine.index, "hit_tokens": dict(stats.hit_tokens),
                            "evicted_blocks": dict(stats.evicted_blocks), "loaded_blocks": dict(stats.loaded_blocks),
                            "offloaded_blocks": dict(stats.offloaded_blocks),
                            "load_failures": dict(stats.load_failures),
                            "store_errors": {**stats.store_errors, "dropped_writes": stats.dropped_writes},
                            "preemptions": engine.scheduler.num_preemptions, "steps": engine.steps,
                            "step_cpu_s": engine.step_cpu_s})
        at_end = {}
        if self.config.audit:
            for engine in self.engines:
                for tier, counts in engine.tiers.audit().items():
                    at_end[f"{tier}_used_at_end"] = at_end.get(f"{tier}_used_at_end", 0) + counts.used
                    at_end[f"{tier}_in_flight_at_end"] = at_end.get(f"{tier}_in_flight_at_end", 0) + counts.in_flight
        return SimResult(self.config, self.cost.source, self.records,
                         num_prompt_blocks(self.trace, self.config.block_size), ideal, engines,
                         self.store.evictions if self.store is not None else 0, wall_s, self._audited, at_end,
                         self.drafts.report() if self.drafts is not None else None, self._itl)
