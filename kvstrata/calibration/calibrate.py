"""Fit the simulator's cost model to the real engine (`kvstrata calibrate`); `kvstrata.calibration.validation` checks it.

`calibrate` runs the real `LLMEngine` over a grid of batch shapes and times whole steps:

    prefill   a chunk of n new tokens after a cached prefix of s tokens    (n x s grid; s = 32: a
              first turn after a shared system prompt)
    burst     k prompts of n tokens arriving together: k prefill chunks in one step
    decode    B requests decoding at context c, sharing all but their last block (cascade groups)
              and with nothing shared (each reads its own blocks)
    mixed     a prefill arriving while B requests decode

then fits `compute` by non-negative least squares on relative error (cost_model.fit). Prompts are
fresh for every run of the grid, so each repeat has the same shapes; each step keeps its median.
It also times the engine's device -> host copies (`host_link`), encoding and decoding a block's
store record (`record_link`, `decode_link`) and reading blocks back from a store (`store_link`: a disk store in
the temp folder, or the Redis of `--store redis://...`, as engines sharing it load). With `--trace` it
replays trace slices on the engine too and fits their steps as well; the profile's `fitted_on`
names the grid and every such slice, and `simulate --validate` refuses those slices.

Steps are timed by the engine thread's CPU time by default (`--clock wall` for a machine of one's
own); validate with the same clock. This imports torch (through the engine); the simulator never does.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvstrata.calibration.engine_replay import (
    BLOCK_SIZE,
    CLOCKS,
    MAX_CHUNK,
    ShapeRecorder,
    lay_out_as_after_traffic,
    loadavg,
    replay_on_engine,
    speed_probe,
    warm_up,
)
from kvstrata.calibration.fitted_on import engine_path, slice_identity
from kvstrata.calibration.slices import SLICES, time_scale_for
from kvstrata.core.config import EngineConfig
from kvstrata.core.machine import machine as current_machine
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.kvcache.stores import open_store
from kvstrata.sim.batch_shape import BatchShape
from kvstrata.sim.cost_model import CostModel, Link, fit, relative_errors

logger = logging.getLogger(__name__)

# prefix -> chunks; a short prefix with long chunks is a chat's first turn after a shared system prompt;
# fresh chunks across 512 tokens pin the causal kernel's key tiles (batch_shape.causal_pairs)
PREFILL_GRID = {0: (16, 128, 256, 512, 768, 1024), 32: (384, 992), 512: (128, 512), 1024: (16, 256, 512),
                2048: (64, 256)}
BURSTS = ((2, 256), (4, 64), (8, 16), (8, 96))                                    # (prompts, tokens each)
DECODE_GRID = {64: (1, 2, 4, 8, 16, 32), 512: (1, 2, 4, 8), 1024: (1, 2, 4)}       # context -> batch sizes
DISTINCT_DECODES = {256: (4, 16), 1024: (4, 8)}      # context -> batch sizes, no prefix shared
DECODE_STEPS = 6
# (batch, context, prefill, shared): decodes (sharing one prefix, or each with a context of its own)
# joined by a fresh prefill; distinct long contexts read their KV from memory behind a big chunk
MIXED = ((8, 512, 512, True), (16, 64, 256, True), (4, 1024, 512, False))
CLOCK_NAMES = {"cpu": "engine-thread CPU time", "wall": "wall time"}


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


def _timed(engine, recorder: ShapeRecorder, timer: Callable[[], float]) -> Iterator[tuple[BatchShape, float]]:
    """Step the engine until idle; yield each non-empty step's shape and duration."""
    while engine.has_work:
        started = timer()
        engine.step()
        seconds = timer() - started
        if recorder.last is not None:
            yield recorder.last, seconds


@dataclass
class _GridRun:
    """One pass over the grid: the engine it steps, how it is timed, and where its fresh prompts come from."""

    engine: object
    recorder: ShapeRecorder
    timer: Callable[[], float]
    rng: np.random.Generator
    one: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=1, ignore_eos=True,
                                                                       temperature=0.0))
    decode: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=DECODE_STEPS + 1,
                                                                          ignore_eos=True, temperature=0.0))

    def tokens(self, n: int) -> list[int]:
        return _tokens(self.rng, n, self.engine.loaded.arch.vocab_size)

    def run(self) -> Iterator[tuple[BatchShape, float]]:
        return _timed(self.engine, self.recorder, self.timer)


def _grid_run(engine, recorder: ShapeRecorder, timer: Callable[[], float],
              seed: int) -> list[tuple[BatchShape, float]]:
    """One pass over the grid with prompts no earlier pass has cached."""
    grid = _GridRun(engine, recorder, timer, np.random.default_rng(seed))
    return [*_prefills(grid), *_bursts(grid), *_decodes(grid), *_mixed(grid)]


def _prefills(grid: _GridRun) -> list[tuple[BatchShape, float]]:
    """PREFILL_GRID: each prefix computed and cached, then each chunk after it."""
    points: list[tuple[BatchShape, float]] = []
    for prefix, chunks in PREFILL_GRID.items():
        shared = grid.tokens(prefix)
        if prefix:
            grid.engine.add_request(shared + grid.tokens(1), grid.one)      # computes and caches the prefix
            points += grid.run()
        for n in chunks:
            grid.engine.add_request(shared + grid.tokens(n), grid.one)
            points += grid.run()
    return points


def _bursts(grid: _GridRun) -> list[tuple[BatchShape, float]]:
    """BURSTS: prompts arriving together, prefilled in one step."""
    points: list[tuple[BatchShape, float]] = []
    for prompts, n in BURSTS:
        for _ in range(prompts):
            grid.engine.add_request(grid.tokens(n), grid.one)
        points += grid.run()
    return points


def _decodes(grid: _GridRun) -> list[tuple[BatchShape, float]]:
    """DECODE_GRID (batches sharing all but their last block), then DISTINCT_DECODES (nothing shared)."""
    points: list[tuple[BatchShape, float]] = []
    for context, batches in DECODE_GRID.items():
        shared = grid.tokens(context - BLOCK_SIZE)
        grid.engine.add_request(shared + grid.tokens(1), grid.one)          # the batch shares this prefix
        points += grid.run()
        for batch in batches:
            for _ in range(batch):
                grid.engine.add_request(shared + grid.tokens(BLOCK_SIZE), grid.decode)
            points += grid.run()
    for context, batches in DISTINCT_DECODES.items():
        for batch in batches:
            for _ in range(batch):
                grid.engine.add_request(grid.tokens(context), grid.decode)
            points += grid.run()
    return points


def _mixed(grid: _GridRun) -> list[tuple[BatchShape, float]]:
    """MIXED: a batch brought to decoding, then a fresh prefill joins it."""
    points: list[tuple[BatchShape, float]] = []
    for batch, context, prefill, shared_prefix in MIXED:
        shared = grid.tokens(context - BLOCK_SIZE) if shared_prefix else []
        if shared_prefix:
            grid.engine.add_request(shared + grid.tokens(1), grid.one)
            points += grid.run()
        for _ in range(batch):
            grid.engine.add_request(shared + grid.tokens(context - len(shared)), grid.decode)
        steps = grid.run()
        for point in steps:                                                # its prefills, then a decode step
            points.append(point)
            if point[0].prefill_tokens == 0:
                break
        points.append(next(steps))                                         # the batch is decoding now
        grid.engine.add_request(grid.tokens(prefill), grid.one)
        points += steps
    return points


def _best(action: Callable[[], object], timer: Callable[[], float], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        started = timer()
        action()
        times.append(timer() - started)
    return min(times)


def _link(one: float, many: float, block_bytes: int, blocks: int = 32) -> Link:
    """A link from the time to move one block and `blocks` blocks: latency and bandwidth."""
    bandwidth = (blocks - 1) * block_bytes / max(many - one, 1e-9)
    return Link(latency_s=max(0.0, one - block_bytes / bandwidth), bandwidth=bandwidth)


def _transfer_links(engine, timer: Callable[[], float], store: str) -> tuple[Link, Link, Link, Link]:
    """The engine's own device -> host block copies (one block, then 32: latency and bandwidth);
    the time to encode one block's store record and to decode one (a bandwidth over the block's
    bytes each: decoding checks and copies more, so each has its own link);
    the `store`'s loads of such records while the engine steps (`_store_link`)."""
    buffers = engine.runner.buffers
    block_bytes = engine.runner.spec.bytes_per_block
    one = _best(lambda: buffers.copy("device", "host", [(0, 0)]), timer)
    many = _best(lambda: buffers.copy("device", "host", [(i, i) for i in range(32)]), timer)
    tokens = list(range(BLOCK_SIZE))
    record = buffers.encode("device", 0, b"\0" * 16, tokens)
    encode = _best(lambda: buffers.encode("device", 0, b"\0" * 16, tokens), timer)
    decode = _best(lambda: buffers.decode_into("device", 1, record, b"\0" * 16, tokens), timer)
    store = _store_link(record, lambda: _decode_step(engine), store)
    while engine.has_work:              # what comes next (the speed probe) finds the engine idle
        engine.step()
    return (_link(one, many, block_bytes), Link(latency_s=0.0, bandwidth=block_bytes / encode),
            Link(latency_s=0.0, bandwidth=block_bytes / decode), store)


def _store_name(spec: str) -> str:
    """The store the link was measured on, for the profile's source (a URL without its password)."""
    if spec == "disk":
        return f"a disk store in {tempfile.gettempdir()}"
    return f"{spec.split('://')[0]} at {spec.rsplit('@', 1)[-1].split('://')[-1]}"


def _decode_step(engine) -> None:
    if not engine.has_work:
        engine.add_request(list(range(1, 65)), SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
    engine.step()


def _store_link(record: bytes, busy: Callable[[], None], spec: str = "disk", repeat: int = 5) -> Link:
    """A store's loads (`spec`: "disk", a disk store in a temp folder, or a `--store` URL such as
    redis://host:port/db): records just written, read back on a store thread while `busy` runs the
    engine's step loop (as a load runs), one then 32, the median of `repeat`, in wall time. A store
    that is also writing shares its threads with the writes, so this link is optimistic for it
    (figures in docs/design/simulator.md, "Calibration")."""
    with tempfile.TemporaryDirectory(prefix="kvstrata-calibrate-") as folder, ThreadPoolExecutor(1) as thread:
        store = open_store(spec, folder, 1024 * len(record), timeout_s=5.0)
        if store is None:
            raise ValueError("calibration measures a store link: --store must name one (disk or a URL), not none")
        stamp = time.time_ns().to_bytes(8, "big")       # keys of their own in a store that outlives the run
        fresh = (stamp + i.to_bytes(8, "big") for i in itertools.count())

        def read(keys: list[bytes]) -> float:
            store.get(keys)
            return time.perf_counter()

        def load(blocks: int) -> float:
            keys = [next(fresh) for _ in range(blocks)]
            store.put([(key, record) for key in keys])
            started = time.perf_counter()
            done = thread.submit(read, keys)
            while not done.done():
                busy()
            return done.result() - started

        try:
            one, many = (statistics.median(load(blocks) for _ in range(repeat)) for blocks in (1, 32))
        finally:
            store.close()
        return _link(one, many, len(record))


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


def calibrate(threads: int | None = 1, repeat: int = 3, machine: str | None = None, clock: str = "cpu",
              trace: str | Path | None = None, slices: tuple[str, ...] = (), store: str = "disk",
              model: str | None = None, load_format: str = "auto",
              deadline: Callable[[CostModel], float] | None = None) -> Calibration:
    """Fit a profile to `model` (default: the embedded one; `load_format` dummy: its real shape with random
    weights) on this machine: the grid, and `slices` of `trace` if named; the store link is `store`'s
    (see `_store_link`). `threads` None is torch's choice, what `kvstrata serve` runs (the CLI's default,
    timed by the wall clock: `engine_timing`). The grid runs
    `repeat` passes, then more while the fit moves and a pass ends before `deadline(the fit so far)`
    (a perf_counter time; None: exactly `repeat`)."""
    from kvstrata.engine.llm_engine import LLMEngine

    config = EngineConfig.from_options(model=model, load_format=load_format, block_size=BLOCK_SIZE, kv_cache_memory="512MiB", max_model_len=4096,
                                       max_num_batched_tokens=MAX_CHUNK, max_num_seqs=64, threads=threads,
                                       num_host_blocks=32, max_tpot_ms=0)
    # max_tpot_ms=0: a step-time target would cut the grid's prefill by what each step measured, so two passes
    # would schedule different batches
    engine = LLMEngine(config)
    recorder = ShapeRecorder(engine.runner, engine.loaded.arch.windows)
    engine.runner = recorder
    lay_out_as_after_traffic(engine)
    warm_up(engine)
    shapes, seconds, passes = _grid_medians(engine, recorder, CLOCKS[clock], repeat, deadline)
    spec = recorder.runner.spec
    host_link, record_link, decode_link, store_link = _transfer_links(engine, CLOCKS[clock], store)
    probe = speed_probe(engine, CLOCKS[clock])
    fitted_on = [_grid_identity(len(shapes), passes, probe, clock)]
    profile = dict(kv_bytes_per_token=spec.bytes_per_block // spec.block_size, host_link=host_link,
                   store_link=store_link, record_link=record_link, decode_link=decode_link,
                   decode_in_place=recorder.runner.decodes_in_place, layer_windows=recorder.layer_windows,
                   machine={**current_machine().as_dict(), "dtype": str(engine.loaded.dtype).removeprefix("torch."),
                            "model": engine.loaded.name,
                            "path": engine_path(engine.loaded.runs(), torch.get_num_threads())},
                   source=(f"calibrated on {machine or current_machine().describe()}, {datetime.date.today().isoformat()}, model "
                           f"{engine.loaded.name} ({engine.loaded.dtype}, {torch.get_num_threads()} threads), "
                           f"{len(shapes)} grid steps x {passes} runs{' + trace slices ' + ','.join(slices) if slices else ''}"
                           f" timed by {CLOCK_NAMES[clock]}; store link: {_store_name(store)}"))
    loaded = engine.loaded
    engine.close()
    fitted_on += _replay_slices(trace, slices, shapes, seconds, profile, threads, clock, loaded)
    model = fit(shapes, seconds, fitted_on=tuple(fitted_on), **profile)
    return Calibration(model, shapes, seconds)


def _grid_medians(engine, recorder: ShapeRecorder, timer: Callable[[], float], repeat: int,
                  deadline: Callable[[CostModel], float] | None) -> tuple[list[BatchShape], list[float], int]:
    """Passes over the grid until the fit settles: at least `repeat`, then more while the last pass moved
    the fitted step times by more than SETTLED (`_moved`) and another ends before `deadline(the fit so
    far)`; its steps' shapes, each step's median time, and the passes run. Noise is what more passes
    average out: a step of one shape varies by 10% and more between passes."""
    runs: list[list[tuple[BatchShape, float]]] = []
    fitted: CostModel | None = None
    while True:
        started = time.perf_counter()
        runs.append(_grid_run(engine, recorder, timer, seed=len(runs) + 1))
        shapes = [shape for shape, _ in runs[0]]
        if [shape for shape, _ in runs[-1]] != shapes:
            raise RuntimeError("calibration runs scheduled different batches; cannot pair their steps")
        medians = [statistics.median(run[i][1] for run in runs) for i in range(len(shapes))]
        pass_s = time.perf_counter() - started
        previous, fitted = fitted, _fit_alone(shapes, medians, recorder.runner.decodes_in_place)
        moved = _moved(shapes, previous, fitted)
        logger.info("grid pass %d: %.0f s; the fit moved %s", len(runs), pass_s,
                    "n/a" if moved is None else f"{moved:.2%} (p90 over the grid's steps)")
        if len(runs) < repeat:
            continue
        if deadline is None or (moved is not None and moved <= SETTLED) or \
                time.perf_counter() + pass_s > deadline(fitted):
            return shapes, medians, len(runs)


SETTLED = 0.02       # a pass that moves the fitted step times by less than this (p90 over the grid) adds nothing


def _moved(shapes: list[BatchShape], before: CostModel | None, after: CostModel) -> float | None:
    """How far one more pass moved the fit: p90 over the grid's steps of |predicted after / before - 1|."""
    if before is None:
        return None
    changes = [abs(after.step_seconds(s) / before.step_seconds(s) - 1) for s in shapes]
    return float(np.percentile(changes, 90))


def _fit_alone(shapes: list[BatchShape], seconds: list[float], in_place: bool = True) -> CostModel:
    """The step-time fit without the links (measured after the grid): for judging the fit mid-way."""
    return fit(shapes, seconds, source="the grid so far", kv_bytes_per_token=0, host_link=Link(0.0, 1.0),
               store_link=Link(0.0, 1.0), decode_in_place=in_place)


def _grid_identity(steps: int, repeat: int, probe: float, clock: str) -> dict:
    """What `fitted_on` records of the grid, with the speed probe and the load average it ran beside."""
    return {"kind": "grid", "steps": steps, "repeat": repeat, "clock": clock, "probe_s": round(probe, 6),
            "loadavg": loadavg(), "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "prefill": {str(k): v for k, v in PREFILL_GRID.items()}, "bursts": BURSTS,
            "decode": {str(k): v for k, v in DECODE_GRID.items()},
            "distinct_decodes": {str(k): v for k, v in DISTINCT_DECODES.items()}, "mixed": MIXED}


def _replay_slices(trace: str | Path | None, names: tuple[str, ...], shapes: list[BatchShape], seconds: list[float],
                   profile: dict, threads: int | None, clock: str, loaded) -> list[dict]:
    """Replay each named slice on the engine at load 1.0 (as the profile fitted so far reckons it),
    adding its steps to `shapes` and `seconds`; returns what `fitted_on` records of each."""
    identities = []
    for name in names:
        if trace is None:
            raise ValueError("fitting on trace slices needs --trace")
        requests, lines = SLICES[name].load(trace)
        scale = time_scale_for(requests, fit(shapes, seconds, **profile), 1.0, SLICES[name].tokens_per_id)
        requests = [dataclasses.replace(r, arrival=r.arrival * scale) for r in requests]
        run = replay_on_engine(requests, SLICES[name].sim_config(), threads, clock, loaded)
        shapes += [shape for shape, _ in run.steps]
        seconds += [t for _, t in run.steps]
        identities.append(slice_identity(trace, name, lines))
    return identities
