"""`kvstrata simulate --validate`: trace slices replayed on the real engine and in the simulator.

A validation names a *slice* (which requests of which trace, cut how, with which caches) and replays
it at three *loads*: arrivals are stretched so the offered work (the profile's estimate of serving
the requests one at a time, with what an unbounded cache would hold cached) is `light` 0.3, `near`
1.0 and `overload` 3.0 of the time they span (decodes batch, so `near` is near, not past, capacity;
`overload` runs well past its arrivals). Each load reports TTFT p50/p90/p99, TPOT p50, throughput
and the hit rate per tier, engine against simulator, with the machine's load average before and
after each engine run and a speed probe (a fixed small workload) against the one calibration
timed: engine timings on a shared machine drift with the neighbours. `repeat` replays the engine
again and reports the spread: an error inside that spread is noise, not the model.

    plain     a real slice of the conversation trace (from request 500), prompts cut to 1,024
              tokens: requests share only the system prompt, device cache only
    sessions  whole chat sessions picked from the same trace (a turn's prompt extends an earlier
              turn's), each hash id shrunk to 32 tokens (`traces.shrink`) so a session fits the
              engine's context; small device cache, a host tier and a disk store, so prefixes come
              back from every tier

Steps are timed by the engine thread's CPU time (`--clock cpu`, neighbours do not count); a step
that runs nothing adds the wall time it blocked waiting for store transfers (`TransferWaits`), the
time a load really keeps a request waiting. A profile names what it was fitted on
(`CostModel.fitted_on`); a slice that shares a request with it is refused (`check_not_fitted_on`):
that would measure the fit, not the model.
"""

from __future__ import annotations

import hashlib
import logging
import math
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvstrata.core.hashing import BlockHasher
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.sim.batch_shape import BatchShape
from kvstrata.sim.cost_model import CostModel
from kvstrata.sim.simulator import TIERS, RequestRecord, SimConfig, Simulator, summarize
from kvstrata.sim.traces import (
    TRACE_BLOCK,
    TraceRequest,
    TraceTokens,
    ideal_hits,
    read_mooncake,
    shrink,
)

logger = logging.getLogger(__name__)

LOADS = {"light": 0.3, "near": 1.0, "overload": 3.0}     # offered work / span of the arrivals
BLOCK_SIZE = 16
MAX_CHUNK = 1024                                          # the step token budget of calibration and validation
SESSION_HORIZON = 4000                                    # requests scanned for sessions after `skip`
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}
CLOCK_NAMES = {"cpu": "engine-thread CPU time (and the wall time a step that ran nothing waited for the store)",
               "wall": "wall time"}


class FittedOnError(ValueError):
    """The profile was fitted on requests of this slice: validating on them would measure the fit."""


@dataclass(frozen=True)
class Slice:
    """Requests of a trace, how they are cut, and the caches both sides run them with (tokens)."""

    name: str
    skip: int = 500
    requests: int = 40
    max_input_tokens: int = 1024
    max_output_tokens: int = 16
    sessions: bool = False             # whole chat sessions from `skip` on, one arrival a second, in trace order
    tokens_per_id: int = TRACE_BLOCK
    device_cache_tokens: int = 16384
    host_cache_tokens: int = 0
    store: bool = False                # a disk store (unbounded in the simulator)

    def load(self, path: str | Path) -> tuple[list[TraceRequest], list[int]]:
        """The slice's requests (arrivals from 0, unscaled) and their line numbers in the trace."""
        if not self.sessions:
            trace = read_mooncake(path, self.requests, self.skip, 1.0, self.max_input_tokens, self.max_output_tokens)
            return spread_ties(trace), list(range(self.skip, self.skip + len(trace)))
        scanned = read_mooncake(path, SESSION_HORIZON, self.skip)
        lines = session_lines([r.hash_ids for r in scanned], self.requests)
        picked = shrink([scanned[i] for i in lines], self.tokens_per_id)
        trace = [cap(r, float(rank), self.max_input_tokens, self.max_output_tokens, self.tokens_per_id)
                 for rank, r in enumerate(picked)]
        return trace, [self.skip + i for i in lines]

    def sim_config(self, max_num_seqs: int = 32, policy: str = "fcfs") -> SimConfig:
        return SimConfig(block_size=BLOCK_SIZE, device_cache_tokens=self.device_cache_tokens,
                         host_cache_tokens=self.host_cache_tokens, store_cache_tokens=None if self.store else 0,
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=MAX_CHUNK, policy=policy,
                         tokens_per_id=self.tokens_per_id).validate()


SLICES = {
    "plain": Slice("plain"),
    "sessions": Slice("sessions", requests=80, sessions=True, tokens_per_id=32, device_cache_tokens=1536,
                      host_cache_tokens=1024, store=True),
}


def spread_ties(trace: list[TraceRequest]) -> list[TraceRequest]:
    """Requests stamped with one time (the trace rounds its stamps to seconds) spread evenly until
    the next stamp, the last group over the mean gap; otherwise every load level meets the same bursts."""
    stamps = sorted({r.arrival for r in trace})
    if len(stamps) < 2:
        return trace
    gaps = dict(zip(stamps, [b - a for a, b in zip(stamps, stamps[1:])] + [(stamps[-1] - stamps[0]) / (len(stamps) - 1)]))
    ties: dict[float, int] = {}
    for r in trace:
        ties[r.arrival] = ties.get(r.arrival, 0) + 1
    seen: dict[float, int] = {}
    out = []
    for r in trace:
        index = seen.get(r.arrival, 0)
        seen[r.arrival] = index + 1
        out.append(replace(r, arrival=r.arrival + gaps[r.arrival] * index / ties[r.arrival]))
    return out


def cap(request: TraceRequest, arrival: float, max_input: int, max_output: int, tokens_per_id: int) -> TraceRequest:
    length = min(request.input_length, max_input)
    return TraceRequest(arrival, length, min(request.output_length, max_output),
                        request.hash_ids[:math.ceil(length / tokens_per_id)])


def session_lines(hash_ids: list[tuple[int, ...]], count: int, min_turns: int = 3) -> list[int]:
    """Indices of `count` requests that belong to chat sessions of at least `min_turns` turns.

    A request continues the session of the earlier request it shares the longest prefix of two or
    more ids with (one id alone is the system prompt every request shares); sessions are taken
    whole, in order of their first turn, and the requests returned in trace order.
    """
    owner: dict[tuple[int, ...], int] = {}
    session_of: list[int] = []
    for index, ids in enumerate(hash_ids):
        session = index
        for k in range(len(ids), 1, -1):
            if ids[:k] in owner:
                session = owner[ids[:k]]
                break
        session_of.append(session)
        for k in range(2, len(ids) + 1):
            owner.setdefault(ids[:k], session)
    members: dict[int, list[int]] = {}
    for index, session in enumerate(session_of):
        members.setdefault(session, []).append(index)
    picked: list[int] = []
    for session in sorted(members):
        if len(members[session]) >= min_turns and len(picked) < count:
            picked += members[session]
    if len(picked) < count:
        raise ValueError(f"only {len(picked)} requests in sessions of {min_turns}+ turns; ask for fewer")
    return sorted(picked)[:count]


# ---- what a profile was fitted on ---------------------------------------------------------------
def trace_digest(path: str | Path) -> str:
    """sha256 of the trace file: names its content, wherever it lies."""
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        for part in iter(lambda: data.read(1 << 20), b""):
            digest.update(part)
    return digest.hexdigest()


def slice_identity(path: str | Path, name: str, lines: list[int]) -> dict:
    """What `fitted_on` records of a trace slice: the trace's digest and the lines (as ranges) used."""
    ranges: list[list[int]] = []
    for line in sorted(lines):
        if ranges and ranges[-1][1] == line:
            ranges[-1][1] = line + 1
        else:
            ranges.append([line, line + 1])
    return {"kind": "trace", "slice": name, "trace": Path(path).name, "sha256": trace_digest(path), "lines": ranges}


def check_not_fitted_on(cost: CostModel, identity: dict) -> None:
    """Refuse a validation on requests the profile was fitted on."""
    mine = {line for a, b in identity["lines"] for line in range(a, b)}
    for fitted in cost.fitted_on:
        if fitted.get("kind") != "trace" or fitted.get("sha256") != identity["sha256"]:
            continue
        shared = mine & {line for a, b in fitted["lines"] for line in range(a, b)}
        if shared:
            raise FittedOnError(f"the profile was fitted on {len(shared)} of this slice's {len(mine)} requests "
                                f"({fitted['trace']}, slice {fitted.get('slice')!r}, lines {fitted['lines']}); "
                                "a validation needs requests it never saw: pick another --skip or slice")


# ---- the engine side ----------------------------------------------------------------------------
@dataclass
class EngineRun:
    records: list[RequestRecord]
    hit_tokens: dict[str, int]
    steps: list[tuple[BatchShape, float]]       # non-empty steps: shape and time
    waited_s: float                             # time in steps that ran nothing (waiting for the store)
    preemptions: int


class ShapeRecorder:
    """Stands in for the engine's runner to note each step's batch shape, then runs it."""

    def __init__(self, runner):
        self.runner = runner
        self.last: BatchShape | None = None

    def execute(self, output):
        self.last = None if output.is_empty else BatchShape.of(output.chunks, self.runner.block_size,
                                                               self.runner.decodes_in_place)
        return self.runner.execute(output)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)          # the rest of the runner, as the engine sees it


def replay_on_engine(trace: list[TraceRequest], config: SimConfig, threads: int | None, clock: str = "cpu",
                     loaded=None) -> EngineRun:
    """Replay arrivals on the real engine with the slice's caches (a fresh disk store in a temp folder).

    With the wall clock, arrivals wait in real time; with the CPU clock, time is the sum of the
    engine's step times (CPU time; wall time for a step that ran nothing) and idle gaps jump to
    the next arrival.
    """
    from kvstrata.core.config import EngineConfig
    from kvstrata.engine.llm_engine import LLMEngine

    max_len = max(r.input_length + r.output_length for r in trace)
    with tempfile.TemporaryDirectory(prefix="kvstrata-validate-") as store_dir:
        engine = LLMEngine(EngineConfig.from_options(
            block_size=config.block_size, num_device_blocks=config.device_cache_tokens // config.block_size,
            num_host_blocks=(config.host_cache_tokens or 0) // config.block_size,
            store="disk" if config.store_cache_tokens != 0 else "none",
            store_path=store_dir if config.store_cache_tokens != 0 else None, persist=False,
            write_policy=config.write_policy, store_timeout=config.store_timeout,
            max_model_len=max_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, policy=config.policy, threads=threads), loaded)
        try:
            fault_in_kv(engine)             # not warm_up: its prompt would take device blocks
            return _replay(engine, trace, config, clock)
        finally:
            engine.close()


def _replay(engine, trace: list[TraceRequest], config: SimConfig, clock: str) -> EngineRun:
    recorder = ShapeRecorder(engine.runner)
    engine.runner = recorder
    waits = TransferWaits(engine.tiers)
    timer, wall = CLOCKS[clock], clock == "wall"
    tokens = TraceTokens(BlockHasher.create(config.block_size, "validation"), config.tokens_per_id)
    prompts = [tokens.prompt(r) for r in trace]
    records = [RequestRecord(r.arrival, r.input_length, r.output_length) for r in trace]
    steps: list[tuple[BatchShape, float]] = []
    waited = 0.0
    pending = deque(range(len(trace)))
    started, now = time.perf_counter(), 0.0
    while pending or engine.has_work:
        if wall:
            now = time.perf_counter() - started
        while pending and trace[pending[0]].arrival <= now:
            index = pending.popleft()
            engine.add_request(prompts[index], SamplingParams(max_tokens=trace[index].output_length,
                                                              ignore_eos=True, temperature=0.0), str(index))
        if not engine.has_work:
            if wall:
                time.sleep(max(0.0, trace[pending[0]].arrival - now))
            else:
                now = trace[pending[0]].arrival
            continue
        begun, blocked = timer(), waits.seconds
        outputs = engine.step()
        seconds = timer() - begun
        if recorder.last is not None:
            steps.append((recorder.last, seconds))
        elif not wall:                      # ran nothing: its work, then the wait for transfers in real time
            seconds += waits.seconds - blocked
            waited += seconds
        now = time.perf_counter() - started if wall else now + seconds
        for out in outputs:
            record = records[int(out.request_id)]
            if out.new_token_ids and math.isnan(record.first_token):
                record.first_token = now
            if out.finished:
                record.finish, record.cached_tokens = now, out.num_cached_tokens
    return EngineRun(records, dict(engine.tiers.stats.hit_tokens), steps, waited, engine.scheduler.num_preemptions)


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
        warm_up(engine)
        return speed_probe(engine, CLOCKS[clock])
    finally:
        engine.close()


def calibrated_probe(cost: CostModel) -> float | None:
    return next((f.get("probe_s") for f in cost.fitted_on if f.get("kind") == "grid"), None)


# ---- comparing ----------------------------------------------------------------------------------
def offered_work(trace: list[TraceRequest], cost: CostModel, tokens_per_id: int, chunk: int = MAX_CHUNK) -> float:
    """Seconds the profile charges for serving the slice one request at a time, with every prefix
    an unbounded cache would hold (`ideal_hits`) cached."""
    tokens = TraceTokens(BlockHasher.create(BLOCK_SIZE, "offered"), tokens_per_id)
    work = 0.0
    for r, hits in zip(trace, ideal_hits(trace, tokens)):
        for start in range(hits * BLOCK_SIZE, r.input_length, chunk):
            work += cost.step_seconds(BatchShape.alone(start, min(chunk, r.input_length - start), BLOCK_SIZE,
                                                       cost.decode_in_place))
        work += sum(cost.step_seconds(BatchShape.alone(r.input_length + i - 1, 1, BLOCK_SIZE, cost.decode_in_place))
                    for i in range(1, r.output_length))
    return work


def time_scale_for(trace: list[TraceRequest], cost: CostModel, load: float, tokens_per_id: int = TRACE_BLOCK) -> float:
    """Stretch arrivals so the offered work is `load` of their span."""
    span = max(r.arrival for r in trace) - min(r.arrival for r in trace)
    return max(1e-3, offered_work(trace, cost, tokens_per_id) / load / span) if span > 0 else 1.0


FIGURES = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s",
           *(f"hit_rate_{tier}" for tier in (*TIERS, "total")))


def figures(report: dict) -> dict[str, float]:
    """The compared figures (FIGURES) of one `summarize` report."""
    out = {"ttft_p50_s": report["ttft_s"]["p50"], "ttft_p90_s": report["ttft_s"]["p90"],
           "ttft_p99_s": report["ttft_s"]["p99"], "tpot_p50_s": report["tpot_s"]["p50"],
           "throughput_tok_s": report["throughput_tok_s"]}
    out.update({f"hit_rate_{tier}": report["hit_rate"][tier] for tier in (*TIERS, "total")})
    assert tuple(out) == FIGURES
    return out


def step_kind(shape: BatchShape) -> str:
    """A step's kind for the error breakdown: what dominates its cost."""
    if shape.prefill_tokens and shape.decode_seqs:
        return "mixed"
    if shape.prefill_tokens:
        several = "s" if shape.prefill_chunks > 1 else ""
        return f"prefill{several} ({'fresh' if not shape.masked_pairs else 'continued' if not shape.attention_pairs else 'both'})"
    return f"decode x{shape.decode_seqs}" if shape.decode_seqs < 4 else "decode x4+"


def step_breakdown(steps: list[tuple[BatchShape, float]], cost: CostModel) -> dict[str, dict]:
    """Engine time against the profile's, per kind of step: where a step-time error comes from."""
    out: dict[str, dict] = {}
    for shape, seconds in steps:
        row = out.setdefault(step_kind(shape), {"steps": 0, "engine_s": 0.0, "profile_s": 0.0})
        row["steps"] += 1
        row["engine_s"] += seconds
        row["profile_s"] += cost.step_seconds(shape)
    return dict(sorted(out.items()))


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def validate_level(trace: list[TraceRequest], config: SimConfig, cost: CostModel, time_scale: float,
                   threads: int | None, clock: str, repeat: int = 1, loaded=None) -> dict:
    """One slice at one time scale: the simulator once (it is deterministic), the engine `repeat` times."""
    trace = [replace(r, arrival=r.arrival * time_scale) for r in trace]
    size = config.block_size
    blocks = sum(math.ceil(r.input_length / size) for r in trace)
    result = Simulator(trace, config, cost).run()
    sim_report = result.to_json()
    sim_figures = figures(sim_report)
    runs = []
    reference = calibrated_probe(cost)
    for _ in range(repeat):
        before, wall = loadavg(), time.perf_counter()
        probe = probe_now(loaded, threads, clock) if loaded is not None else None
        run = replay_on_engine(trace, config, threads, clock, loaded)
        real = summarize(run.records, {tier: run.hit_tokens.get(tier, 0) // size for tier in TIERS}, blocks)
        busy = sum(t for _, t in run.steps) + run.waited_s
        runs.append({"figures": figures(real), "loadavg_before": before, "loadavg_after": loadavg(),
                     "probe_s": probe, "speed_ratio": probe / reference if probe and reference else None,
                     "wall_s": time.perf_counter() - wall, "engine_s": real["simulated_s"],
                     "busy_share": busy / real["simulated_s"] if real["simulated_s"] else 0.0,
                     "waited_for_store_s": run.waited_s, "preemptions": run.preemptions,
                     "step_seconds": {"steps": len(run.steps), "engine": sum(t for _, t in run.steps),
                                      "profile": sum(cost.step_seconds(s) for s, _ in run.steps)},
                     "step_kinds": step_breakdown(run.steps, cost),
                     "ttft_s": [r.ttft for r in run.records], "tpot_s": [r.tpot for r in run.records],
                     "cached_tokens": [r.cached_tokens for r in run.records]})
    rows = {}
    for name, got in sim_figures.items():
        wants = [r["figures"][name] for r in runs]
        errors = [got / want - 1 if want else None for want in wants]
        known = [e for e in errors if e is not None]
        rows[name] = {"engine": wants, "simulator": got, "relative_error": errors,
                      "engine_spread": (max(wants) / min(wants) - 1) if min(wants) > 0 else None,
                      "error_mean": sum(known) / len(known) if known else None}
    return {"time_scale": time_scale, "figures": rows, "engine_runs": runs,
            "simulator": {**{k: sim_report[k] for k in ("preemptions", "steps", "transfers", "simulated_s")},
                          "ttft_s": [r.ttft for r in result.records], "tpot_s": [r.tpot for r in result.records],
                          "cached_tokens": [r.cached_tokens for r in result.records]}}


def validate(path: str | Path, slice_: Slice, cost: CostModel, threads: int | None, clock: str,
             loads: dict[str, float] | None = None, time_scales: dict[str, float] | None = None,
             repeat: int = 1, max_num_seqs: int = 32) -> dict:
    """A slice at each load (or at given time scales), engine against simulator; refuses a fitted-on slice."""
    trace, lines = slice_.load(path)
    identity = slice_identity(path, slice_.name, lines)
    check_not_fitted_on(cost, identity)
    config = slice_.sim_config(max_num_seqs)
    if time_scales is None:
        time_scales = {name: time_scale_for(trace, cost, load, slice_.tokens_per_id)
                       for name, load in (loads or LOADS).items()}
    from kvstrata.core.config import ModelConfig
    from kvstrata.model.loader import load_model

    loaded = load_model(ModelConfig(threads=threads))        # one load for every engine of the validation
    levels = {}
    for name, scale in time_scales.items():
        logger.info("slice %s, %s: %d requests over %.0f s (time scale %.3g)", slice_.name, name, len(trace),
                    trace[-1].arrival * scale, scale)
        levels[name] = validate_level(trace, config, cost, scale, threads, clock, repeat, loaded)
    return {"slice": {**slice_.__dict__, **{k: identity[k] for k in ("trace", "sha256", "lines")}},
            "requests": len(trace), "clock": CLOCK_NAMES[clock], "profile": cost.source, "levels": levels}
