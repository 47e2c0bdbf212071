"""The simulator against the real engine: fit its cost model (`calibrate`), then check it (`validate`).

`calibrate` runs the real `LLMEngine` over a grid of batch shapes and times whole steps:

    prefill   a chunk of n new tokens after a cached prefix of s tokens    (n x s grid)
    decode    B requests decoding at context c                              (B x c grid)
    mixed     a prefill arriving while B requests decode

then fits `compute` by non-negative least squares on relative error (cost_model.fit). Prompts are
fresh for every run of the grid, so each repeat has the same shapes; each step keeps its median.

`validate` replays one trace slice twice, on the real engine and in the simulator with a
profile, and prints the relative errors of TTFT p50/p90, throughput and hit rate. Arrivals are
scaled so the engine is busy about 60% of the time. Steps are timed by the engine thread's CPU
time by default (`--clock wall` for a machine of one's own); calibrate with the same clock.
Both import torch (through the engine); the simulator itself never does.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import platform
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstrata.config import EngineConfig
from kvstrata.cost_model import BatchShape, CostModel, Link, fit, relative_errors
from kvstrata.kvcache.hashing import BlockHasher
from kvstrata.request import SamplingParams
from kvstrata.simulator import RequestRecord, SimConfig, Simulator, summarize
from kvstrata.traces import TraceRequest, TraceTokens, read_mooncake

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
MAX_CHUNK = 1024                        # calibration's (and validation's) token budget per step
PREFILL_GRID = {0: (16, 128, 512, 1024), 1024: (16, 256, 512), 2048: (64, 256)}    # cached prefix -> chunks
DECODE_GRID = {64: (1, 2, 4, 8, 16, 32), 512: (1, 2, 4, 8), 1024: (1, 2, 4)}       # context -> batch sizes
DECODE_STEPS = 6
MIXED = ((8, 512, 512), (16, 64, 256))                                            # (batch, context, prefill)
VALIDATION_REQUESTS = 24                # the default slice: about a minute of engine CPU time on this machine
VALIDATION_INPUT_TOKENS = 1024          # prompts cut well inside SmolLM2's 8192-token context
VALIDATION_DEVICE_TOKENS = 16384        # KV the engine gets in validation: small enough to evict on a slice
STORE_LINK = Link(100e-6, 1e9)          # assumed, not measured: a local SSD behind the disk store
# Step durations: the engine thread's CPU time (neighbours on a shared machine do not count; with one
# torch thread all compute runs on it) or wall time (the honest figure on a machine of one's own).
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}
CLOCK_NAMES = {"cpu": "engine-thread CPU time", "wall": "wall time"}


class _ShapeRecorder:
    """Stands in for the engine's runner to note each step's batch shape, then runs it."""

    def __init__(self, runner):
        self.runner = runner
        self.last: BatchShape | None = None

    def execute(self, output):
        self.last = None if output.is_empty else BatchShape.of(output.chunks)
        return self.runner.execute(output)


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


def _timed(engine, recorder: _ShapeRecorder, timer: Callable[[], float]) -> Iterator[tuple[BatchShape, float]]:
    """Step the engine until idle; yield each non-empty step's shape and duration."""
    while engine.has_work:
        started = timer()
        engine.step()
        seconds = timer() - started
        if recorder.last is not None:
            yield recorder.last, seconds


def _grid_run(engine, recorder: _ShapeRecorder, timer: Callable[[], float],
              seed: int) -> list[tuple[BatchShape, float]]:
    """One pass over the grid with prompts no earlier pass has cached."""
    rng, vocab = np.random.default_rng(seed), engine.loaded.arch.vocab_size
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    points: list[tuple[BatchShape, float]] = []

    def run() -> Iterator[tuple[BatchShape, float]]:
        return _timed(engine, recorder, timer)

    for prefix, chunks in PREFILL_GRID.items():
        shared = _tokens(rng, prefix, vocab)
        if prefix:
            engine.add_request(shared + _tokens(rng, 1, vocab), one)        # computes and caches the prefix
            points += run()
        for n in chunks:
            engine.add_request(shared + _tokens(rng, n, vocab), one)
            points += run()
    decode = SamplingParams(max_tokens=DECODE_STEPS + 1, ignore_eos=True, temperature=0.0)
    for context, batches in DECODE_GRID.items():
        shared = _tokens(rng, context - BLOCK_SIZE, vocab)
        engine.add_request(shared + _tokens(rng, 1, vocab), one)            # the batch shares this prefix
        points += run()
        for batch in batches:
            for _ in range(batch):
                engine.add_request(shared + _tokens(rng, BLOCK_SIZE, vocab), decode)
            points += run()
    for batch, context, prefill in MIXED:
        shared = _tokens(rng, context - BLOCK_SIZE, vocab)
        engine.add_request(shared + _tokens(rng, 1, vocab), one)
        points += run()
        for _ in range(batch):
            engine.add_request(shared + _tokens(rng, BLOCK_SIZE, vocab), decode)
        steps = run()
        points += [next(steps), next(steps)]                               # the batch is decoding now
        engine.add_request(_tokens(rng, prefill, vocab), one)
        points += steps
    return points


def _host_copy_link(engine) -> Link:
    """Device <-> host on a CPU is a memcpy: time one of 64 MiB."""
    import torch

    src = torch.empty(16 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    started = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    seconds = (time.perf_counter() - started) / 5
    return Link(latency_s=5e-6, bandwidth=src.numel() * src.element_size() / seconds)


def machine_name() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


@dataclass
class Calibration:
    """A fitted profile and the measured steps it was fitted to (kept in the profile file, for refits)."""

    model: CostModel
    shapes: list[BatchShape]
    seconds: list[float]

    def report(self) -> str:
        errors = np.abs(relative_errors(self.model, self.shapes, self.seconds))
        return (f"fit over {len(self.shapes)} steps ({min(self.seconds) * 1000:.1f} ms to {max(self.seconds):.2f} s): "
                f"relative error median {np.median(errors):.1%}, p90 {np.percentile(errors, 90):.1%}, "
                f"max {errors.max():.1%}")

    def save(self, path: str | Path) -> None:
        data = self.model.to_json()
        data["measurements"] = {"columns": [*BatchShape._fields, "seconds"],
                                "rows": [[*shape, round(t, 6)] for shape, t in zip(self.shapes, self.seconds)]}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


def calibrate(threads: int | None = 1, repeat: int = 3, machine: str | None = None,
              clock: str = "cpu") -> Calibration:
    """Fit a profile to the default model on this machine."""
    from kvstrata.engine import LLMEngine

    config = EngineConfig.from_options(block_size=BLOCK_SIZE, kv_cache_memory="512MiB", max_model_len=4096,
                                       max_num_batched_tokens=MAX_CHUNK, max_num_seqs=64, threads=threads)
    engine = LLMEngine(config)
    recorder = _ShapeRecorder(engine.runner)
    engine.runner = recorder
    engine.add_request(list(range(300)), SamplingParams(max_tokens=4, ignore_eos=True))   # warm-up, not measured
    list(_timed(engine, recorder, CLOCKS[clock]))
    runs = [_grid_run(engine, recorder, CLOCKS[clock], seed=run + 1) for run in range(repeat)]
    shapes = [shape for shape, _ in runs[0]]
    if any([shape for shape, _ in run] != shapes for run in runs):
        raise RuntimeError("calibration runs scheduled different batches; cannot pair their steps")
    seconds = [statistics.median(run[i][1] for run in runs) for i in range(len(shapes))]
    spec = recorder.runner.spec
    model = fit(shapes, seconds, kv_bytes_per_token=spec.bytes_per_block // spec.block_size,
                host_link=_host_copy_link(engine), store_link=STORE_LINK,
                source=(f"calibrated on {machine or machine_name()}, {datetime.date.today().isoformat()}, model "
                        f"{engine.loaded.name} ({engine.loaded.dtype}, {threads or 'default'} threads), "
                        f"{len(shapes)} steps x {repeat} runs timed by {CLOCK_NAMES[clock]}; store link assumed"))
    return Calibration(model, shapes, seconds)


# ---- validation ---------------------------------------------------------------------------------
def replay_on_engine(trace: list[TraceRequest], config: SimConfig, max_model_len: int, threads: int | None,
                     clock: str = "cpu") -> tuple[list[RequestRecord], dict[str, int], list[tuple[BatchShape, float]]]:
    """Replay arrivals on the real engine: per-request records, hit tokens per tier, and every step.

    With the wall clock, arrivals wait in real time; with the CPU clock, time is the sum of the
    engine's step CPU times and idle gaps jump to the next arrival.
    """
    from kvstrata.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_options(
        block_size=config.block_size, num_device_blocks=config.device_cache_tokens // config.block_size,
        max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, policy=config.policy, threads=threads))
    recorder = _ShapeRecorder(engine.runner)
    engine.runner = recorder
    timer, wall = CLOCKS[clock], clock == "wall"
    tokens = TraceTokens(BlockHasher.create(config.block_size, "validation"))
    prompts = [tokens.prompt(r) for r in trace]
    records = [RequestRecord(r.arrival, r.input_length, r.output_length) for r in trace]
    steps: list[tuple[BatchShape, float]] = []
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
        begun = timer()
        outputs = engine.step()
        seconds = timer() - begun
        now = time.perf_counter() - started if wall else now + seconds
        if recorder.last is not None:
            steps.append((recorder.last, seconds))
        for out in outputs:
            record = records[int(out.request_id)]
            if out.new_token_ids and math.isnan(record.first_token):
                record.first_token = now
            if out.finished:
                record.finish, record.cached_tokens = now, out.num_cached_tokens
    hits = dict(engine.tiers.stats.hit_tokens)
    engine.close()
    return records, hits, steps


def _auto_time_scale(trace: list[TraceRequest], cost: CostModel, chunk: int, load: float = 0.6) -> float:
    """Stretch arrivals so the engine is busy about `load` of the time (serial, uncached work)."""
    work = 0.0
    for r in trace:
        for start in range(0, r.input_length, chunk):
            n = min(chunk, r.input_length - start)
            work += cost.step_seconds(BatchShape(n, 0, start + n, n * start + n * (n + 1) // 2))
        work += sum(cost.step_seconds(BatchShape(0, 1, r.input_length + i, 0)) for i in range(1, r.output_length))
    span = max(r.arrival for r in trace)
    return max(1e-3, work / load / span) if span > 0 else 1.0


def validate(trace: list[TraceRequest], config: SimConfig, cost: CostModel, time_scale: float | None,
             threads: int | None, clock: str) -> dict:
    """The same slice on the real engine and in the simulator; both reports and the relative errors.

    `time_scale` None stretches arrivals so the engine is busy about 60% of the time.
    """
    scale = time_scale or _auto_time_scale(trace, cost, config.max_num_batched_tokens)
    trace = [TraceRequest(r.arrival * scale, r.input_length, r.output_length, r.hash_ids) for r in trace]
    max_len = max(r.input_length + r.output_length for r in trace)
    logger.info("validating on %d requests over %.0fs (time scale %.3g)", len(trace), trace[-1].arrival, scale)
    records, hits, steps = replay_on_engine(trace, config, max_len, threads, clock)
    size = config.block_size
    blocks = sum(math.ceil(r.input_length / size) for r in trace)
    real = summarize(records, {tier: n // size for tier, n in hits.items()}, blocks)
    sim = Simulator(trace, config, cost).run().to_json()
    pairs = {"ttft_p50_s": (real["ttft_s"]["p50"], sim["ttft_s"]["p50"]),
             "ttft_p90_s": (real["ttft_s"]["p90"], sim["ttft_s"]["p90"]),
             "throughput_tok_s": (real["throughput_tok_s"], sim["throughput_tok_s"]),
             "hit_rate": (real["hit_rate"]["total"], sim["hit_rate"]["total"])}
    return {"requests": len(trace), "time_scale": scale, "clock": CLOCK_NAMES[clock], "profile": cost.source,
            "figures": {name: {"engine": want, "simulator": got, "relative_error": got / want - 1 if want else None}
                        for name, (want, got) in pairs.items()},
            "step_seconds": {"steps": len(steps), "engine": sum(t for _, t in steps),
                             "profile": sum(cost.step_seconds(shape) for shape, _ in steps)},
            "engine": real, "simulator": sim}
