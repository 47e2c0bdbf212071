"""The real engine, run and timed for calibration and validation: trace replays, warm-up, speed probes.

`replay_on_engine` feeds a slice's arrivals to a real `LLMEngine` with the slice's caches (and its
speculative config) and records every request's first and last token and every step's batch shape
and time, the same figures the simulator reports, and with speculation what the simulator takes as
the workload's acceptance (`DraftCounts`). Steps are timed by the engine thread's CPU time (`--clock cpu`,
neighbours do not count) or by wall time (`--clock wall`, for engines of several threads), and the
replay's time is their sum; a step that runs nothing adds the wall time it blocked waiting for
store transfers (`TransferWaits`), the time a load really keeps a request waiting. Engines are
warmed before anything is timed (`fault_in_kv`, `warm_up`), and `speed_probe` times a fixed small
workload, so a report can say how fast the machine runs the engine now against when it was
calibrated (timings on a shared machine drift with the neighbours).
"""

from __future__ import annotations

import logging
import math
import random
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstrata.core.hashing import BlockHasher
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.kvcache.kv_groups import kv_groups_for
from kvstrata.sim.batch_shape import BatchShape, layer_mix
from kvstrata.sim.config import SimConfig
from kvstrata.sim.results import RequestRecord
from kvstrata.sim.traces import TraceRequest, TraceTokens

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
MAX_CHUNK = 1024                                          # the step token budget of calibration and validation
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


@dataclass
class EngineRun:
    records: list[RequestRecord]
    hit_tokens: dict[str, int]
    steps: list[tuple[BatchShape, float]]       # non-empty steps: shape and time
    waited_s: float                             # time in steps that ran nothing (waiting for the store)
    preemptions: int
    drafts: DraftCounts | None = None           # with speculation: drafts and how many were accepted


@dataclass
class DraftCounts:
    """A speculative replay's drafts, as the engine's spec_decode counters count them, and how often a
    decode that could have drafted found a draft (`draft_rate`: an n-gram lookup misses sometimes)."""

    num_drafts: int                             # steps of a request with drafts
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]
    drafted_per_pos: list[int]                  # steps whose draft reached each position (a lookup drafts
                                                # what followed its match: often fewer than K tokens)
    could_draft: int                            # decodes of a speculating request with room for a draft
    drafted_steps: list[int]                    # indices into EngineRun.steps of steps carrying drafts

    @property
    def draft_rate(self) -> float:
        return self.num_drafts / self.could_draft if self.could_draft else 0.0


class ShapeRecorder:
    """Stands in for the engine's runner to note each step's batch shape, then runs it; counts the
    decodes that could have carried drafts and those that did."""

    def __init__(self, runner, layer_windows: Sequence[int | None] | None = None):
        self.runner = runner
        self.layer_windows = tuple(layer_windows or ())     # the model's, by layer (none: every layer global)
        self.mix = layer_mix(self.layer_windows)
        self.last: BatchShape | None = None
        self.last_drafted = False
        self.could_draft = 0
        self.drafted_per_pos: list[int] = []

    def execute(self, output, *rest):
        """The runner's `execute`, noting the step first (`rest`: the step's adapters, passed on)."""
        self.last = None if output.is_empty else BatchShape.of(output.chunks, self.runner.block_size,
                                                               self.runner.decodes_in_place, self.mix)
        self.last_drafted = any(c.draft_token_ids for c in output.chunks)
        for chunk in output.chunks:
            drafted = self.drafted_per_pos
            drafted.extend([0] * (len(chunk.draft_token_ids) - len(drafted)))
            for position in range(len(chunk.draft_token_ids)):
                drafted[position] += 1
        self.could_draft += sum(1 for c in output.chunks if c.sample and c.request.num_lookahead_tokens
                                and c.num_tokens - len(c.draft_token_ids) == 1 and not c.forks
                                and c.request.sampling.max_tokens - c.request.num_output_tokens > 1)
        return self.runner.execute(output, *rest)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)          # the rest of the runner, as the engine sees it


def replay_on_engine(trace: list[TraceRequest], config: SimConfig, threads: int | None, clock: str = "cpu",
                     loaded=None) -> EngineRun:
    """Replay arrivals on the real engine with the slice's caches (a fresh disk store in a temp folder).

    Time is the sum of the engine's step times by `clock` (a step that ran nothing counts the wall time
    it waited for the store too), and idle gaps jump to the next arrival, as in the simulator: the
    schedule then follows from the steps' times alone. (Arrivals waited in real time with the wall clock
    before: two replays of one slice near saturation, a minute apart, gave TPOT p50 of 74 and 42 ms.)
    """
    from kvstrata.core.config import EngineConfig
    from kvstrata.engine.llm_engine import LLMEngine

    max_len = max(r.input_length + r.output_length for r in trace)
    # the capacities are tokens of every layer, as in the simulator: with KV groups each block is that many pages
    pages = 1 if loaded is None else kv_groups_for(loaded.arch.windows or [None] * loaded.arch.num_layers,
                                                   swa_full=config.swa_full).num_groups
    with tempfile.TemporaryDirectory(prefix="kvstrata-validate-") as store_dir:
        engine = LLMEngine(EngineConfig.from_options(
            block_size=config.block_size, num_device_blocks=config.device_cache_tokens // config.block_size * pages,
            num_host_blocks=(config.host_cache_tokens or 0) // config.block_size * pages, swa_full=config.swa_full,
            store="disk" if config.store_cache_tokens != 0 else "none",
            store_path=store_dir if config.store_cache_tokens != 0 else None, persist=False,
            write_policy=config.write_policy, store_timeout=config.store_timeout,
            max_model_len=max_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, policy=config.policy, threads=threads,
            speculative_config=config.speculative, max_tpot_ms=0), loaded)   # the simulator has no step-time target
        try:
            fault_in_kv(engine)             # not warm_up: its prompt would take device blocks
            lay_out_as_after_traffic(engine)
            return _replay(engine, trace, config, clock)
        finally:
            engine.close()


def _replay(engine, trace: list[TraceRequest], config: SimConfig, clock: str) -> EngineRun:
    recorder = ShapeRecorder(engine.runner, engine.loaded.arch.windows)
    engine.runner = recorder
    waits = TransferWaits(engine.tiers)
    timer = CLOCKS[clock]
    tokens = TraceTokens(BlockHasher.create(config.block_size, "validation"), config.tokens_per_id)
    prompts = [tokens.prompt(r) for r in trace]
    records = [RequestRecord(r.arrival, r.input_length, r.output_length) for r in trace]
    steps: list[tuple[BatchShape, float]] = []
    drafted: list[int] = []
    waited = 0.0
    pending = deque(range(len(trace)))
    now = 0.0
    while pending or engine.has_work:
        while pending and trace[pending[0]].arrival <= now:
            index = pending.popleft()
            engine.add_request(prompts[index], SamplingParams(max_tokens=trace[index].output_length,
                                                              ignore_eos=True, temperature=0.0), str(index))
        if not engine.has_work:
            now = trace[pending[0]].arrival
            continue
        begun, blocked = timer(), waits.seconds
        outputs = engine.step()
        seconds = timer() - begun
        if recorder.last is not None:
            drafted += [len(steps)] if recorder.last_drafted else []
            steps.append((recorder.last, seconds))
        else:                               # ran nothing: its work, and the wait for transfers in real time
            seconds += (waits.seconds - blocked) if clock == "cpu" else 0.0     # (wall time has the wait)
            waited += seconds
        now += seconds
        for out in outputs:
            record = records[int(out.request_id)]
            if out.new_token_ids and math.isnan(record.first_token):
                record.first_token = now
            if out.finished:
                record.finish, record.cached_tokens = now, out.num_cached_tokens
    stats = engine.stats
    drafts = DraftCounts(stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                         stats.spec_decode_num_accepted_tokens, list(stats.spec_decode_num_accepted_tokens_per_pos),
                         recorder.drafted_per_pos, recorder.could_draft, drafted) if config.speculative is not None else None
    return EngineRun(records, dict(engine.tiers.stats.hit_tokens), steps, waited, engine.scheduler.num_preemptions,
                     drafts)


class TransferWaits:
    """Wall time the engine spends blocked in `TierManager.wait_for_transfers` (a step that ran
    nothing waits there for its store transfers: that wait is real time, the rest of such a step is
    engine-thread work like any other's). Timed whole in wall time instead, such a step carries a
    neighbour's share of the core, and so does the TTFT of every request that loads its prefix from
    the store (docs/design/simulator.md, "Validation")."""

    def __init__(self, tiers, clock: Callable[[], float] = time.perf_counter):
        self.seconds = 0.0
        wait = tiers.wait_for_transfers

        def timed(timeout: float) -> None:
            started = clock()
            try:
                wait(timeout)
            finally:
                self.seconds += clock() - started

        tiers.wait_for_transfers = timed


def speed_probe(engine, timer: Callable[[], float], rounds: int = 3) -> float:
    """Seconds of a fixed small workload (4 fresh prompts of 128 tokens, 8 tokens each), the best of
    `rounds`: calibration records it, validation measures it again, and their ratio says how much
    faster or slower the machine runs the engine now (neighbours slow even CPU time on shared cores)."""
    import numpy as np

    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    times = []
    for _ in range(rounds):
        for _ in range(4):
            engine.add_request(rng.integers(0, 256, 128).tolist(), params)
        started = timer()
        while engine.has_work:
            engine.step()
        times.append(timer() - started)
    return min(times)


def fault_in_kv(engine) -> None:
    """Map every page of the engine's KV buffers now, as an idle server does soon after it starts
    (`PagedKVCache.map_pages`). They come lazily from calloc in 2 MiB transparent huge pages, and a
    block's K/V lies in every plane of every layer, so the first step that writes a fresh engine's
    cache maps nearly all of it, at many times its warm cost (docs/design/simulator.md,
    "Validation"). That is a start-up cost of the engine, not of the step; timed steps must not
    carry it, or the first request of every replay and a calibration step or two do."""
    for cache in engine.runner.buffers.caches.values():
        while cache.map_pages(1 << 30):
            pass


def lay_out_as_after_traffic(engine, seed: int = 0) -> None:
    """A fresh engine's device blocks scattered as a server's are after traffic (`BlockPool.scatter_free`):
    every engine calibration and validation time starts so, or each fresh engine's first requests read
    contiguous blocks, faster than the grid's engine reads its own."""
    engine.tiers.device.scatter_free(random.Random(seed))


def warm_up(engine) -> None:
    """The engine's KV pages mapped (`fault_in_kv`) and one step of a whole chunk budget, not
    timed: a process's first forward of a large batch also costs more than the next, so
    calibration and the speed probe start warm."""
    fault_in_kv(engine)
    engine.add_request([7] * MAX_CHUNK, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_work:
        engine.step()


def probe_now(loaded, threads: int | None, clock: str) -> float:
    """`speed_probe` on a small warmed-up engine of its own (the validation's engine starts from an
    empty cache)."""
    from kvstrata.core.config import EngineConfig
    from kvstrata.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_options(block_size=BLOCK_SIZE, num_device_blocks=256,
                                                 max_model_len=MAX_CHUNK + 16, max_num_batched_tokens=MAX_CHUNK,
                                                 threads=threads), loaded)
    try:
        lay_out_as_after_traffic(engine)
        warm_up(engine)
        return speed_probe(engine, CLOCKS[clock])
    finally:
        engine.close()


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []
