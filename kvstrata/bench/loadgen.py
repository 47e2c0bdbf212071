"""Drive a workload against servers: open-loop arrivals, sessions, a concurrency cap, alternation.

Sessions start at their arrival times whatever the server's state (open loop); a session's later
turns follow its previous reply after `turn_gap` seconds. `max_concurrency` caps requests in
flight (a request past its arrival time waits for a slot, and its latency counts from when it is
sent, as in `vllm bench serve`).

Comparisons alternate: repeat r runs every target on the workload of seed + r, with the order of
targets rotated by r, so drift on a shared machine (neighbours' load, thermal state) falls on all
targets alike, and no repeat finds another repeat's prompts in a cache.

After a run, the timelines of its requests are fetched from the server if asked (tails.py): outside
the timed run, and before the next run can push them out of the server's bounded store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np

from kvstrata.bench.client import RequestOptions, Target, request_body, resolve_model, send
from kvstrata.bench.metrics import RequestResult
from kvstrata.bench.quiet import wait_quiet
from kvstrata.bench.tails import fetch
from kvstrata.bench.workloads import Session, Workload, WorkloadOptions, random_workload

logger = logging.getLogger(__name__)

WARMUP_SEED = 0x5EED    # warm-up prompts share nothing with any measured workload's
WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN = 32, 8
UNMAPPED = "kvstrata_kv_unmapped_bytes"
MAPPING_PATIENCE = 300.0  # seconds to wait for a server to map its KV memory (2 GiB took 17 s on one host)


@dataclass(frozen=True)
class LoadOptions:
    request_rate: float = math.inf     # sessions per second; inf: all at once
    burstiness: float = 1.0            # gamma shape of inter-arrival gaps; 1 = Poisson, < 1 burstier
    max_concurrency: int | None = None
    warmup_requests: int = 2           # short unrelated requests per target before its first run


@dataclass
class RunResult:
    label: str
    repeat: int
    seed: int
    results: list[RequestResult]
    duration: float                     # first send -> last reply
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    cpu_busy_before: float = 0.0        # share of the cores others used just before the run (quiet.py)
    timelines: dict[str, dict] | None = None   # request id -> the server's timeline; None: not asked or none kept


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start: the first at 0, then gamma gaps of mean 1/rate (shape `burstiness`)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng([seed, 7]).gamma(burstiness, 1.0 / (rate * burstiness), max(0, n - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def schedule(workload: Workload, load: LoadOptions, seed: int) -> list[float]:
    drawn = arrival_times(len(workload.sessions), load.request_rate, load.burstiness, seed)
    return [s.arrival if s.arrival is not None else t for s, t in zip(workload.sessions, drawn)]


async def run_workload(target: Target, workload: Workload, load: LoadOptions, options: RequestOptions,
                       seed: int, repeat: int = 0, on_done: Callable[[], None] = lambda: None,
                       timelines: bool = False) -> RunResult:
    """Send every turn of `workload` to `target`; returns per-request results in send order (and, with
    `timelines`, the server's timelines of them, fetched once the run is over)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=options.timeout) as client:
        model = await resolve_model(client, target)
        url = f"{target.api}/completions"
        slots = asyncio.Semaphore(load.max_concurrency or 1 << 30)
        results: list[RequestResult] = []
        begin = time.perf_counter()

        async def one(prompt: tuple[int, ...], max_tokens: int) -> None:
            async with slots:
                result = await send(client, url, request_body(model, prompt, max_tokens, options), len(prompt),
                                    time.perf_counter() - begin)
            if not result.ok:
                logger.warning("%s: request failed: %s", target.label, result.error)
            results.append(result)
            on_done()

        async def session(s: Session, at: float) -> None:
            await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
            for index, turn in enumerate(s.turns):
                if index:
                    await asyncio.sleep(workload.turn_gap)
                await one(turn.prompt, turn.max_tokens)

        load_before = os.getloadavg()
        await asyncio.gather(*(session(s, at) for s, at in zip(workload.sessions, schedule(workload, load, seed))))
        duration = time.perf_counter() - begin
        load_after = os.getloadavg()
        kept = await fetch(client, target.api, [r.request_id for r in results if r.request_id]) if timelines else None
    results.sort(key=lambda r: r.start)
    return RunResult(target.label, repeat, seed, results, duration, load_before, load_after, timelines=kept)


async def warm_up(target: Target, load: LoadOptions, options: RequestOptions) -> None:
    """A few short requests of their own tokens, so first-call costs (compilation, allocation) are not
    measured; then, for a kvstrata server, a wait until it has mapped its KV memory."""
    if load.warmup_requests:
        warm = random_workload(WorkloadOptions(num_requests=load.warmup_requests, input_len=WARMUP_INPUT_LEN,
                                               output_len=WARMUP_OUTPUT_LEN), WARMUP_SEED)
        await run_workload(target, warm, LoadOptions(), options, seed=0)
    await wait_mapped(target)


async def wait_mapped(target: Target, patience: float = MAPPING_PATIENCE, every: float = 1.0) -> None:
    """Wait until the server says (`kvstrata_kv_unmapped_bytes`, /metrics) that its KV memory is mapped.
    Why: a kvstrata engine maps its lazily allocated KV pages while idle, and a step that writes a page
    not yet mapped pays the fault (docs/design/tiers-and-stores.md: 343 against 422 output tok/s in
    two runs with every request at once); engines that touch all of their KV at start-up (vLLM's zeroed cache) pay it
    before they answer. Servers without the metric are not waited for."""
    deadline, last_log = time.monotonic() + patience, 0.0
    async with httpx.AsyncClient(timeout=10.0) as client:
        while True:
            unmapped = gauge_value((await client.get(target.api.removesuffix("/v1") + "/metrics")).text, UNMAPPED)
            if not unmapped:
                return
            now = time.monotonic()
            if now >= deadline:
                logger.warning("%s: %.0f MiB of KV memory still unmapped after %.0f s; measuring anyway",
                               target.label, unmapped / 2**20, patience)
                return
            if now - last_log >= 10.0:
                logger.warning("%s: waiting for the server to map %.0f MiB of KV memory", target.label,
                               unmapped / 2**20)
                last_log = now
            await asyncio.sleep(every)


def gauge_value(text: str, name: str) -> float | None:
    """The value of an unlabelled metric in Prometheus' text format, or None when it is not there."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def compare(targets: list[Target], build: Callable[[int], Workload], load: LoadOptions,
                  options: RequestOptions, seed: int, repeats: int, patience: float = 0.0,
                  on_done: Callable[[], None] = lambda: None, timelines: bool = False) -> list[RunResult]:
    """Run every target `repeats` times, alternating; repeat r uses the workload of seed + r.
    Each run first waits up to `patience` s for other jobs to leave the cores (the servers idle meanwhile).
    With `timelines`, each run brings back its requests' timelines from servers that keep them."""
    for target in targets:
        await warm_up(target, load, options)
    runs = []
    for repeat in range(repeats):
        workload = build(seed + repeat)
        order = targets[repeat % len(targets):] + targets[:repeat % len(targets)]
        for target in order:
            busy = await asyncio.to_thread(wait_quiet, patience, f"{target.label} repeat {repeat}")
            logger.info("repeat %d: %s (%d requests)", repeat, target.label, workload.num_requests)
            run = await run_workload(target, workload, load, options, seed + repeat, repeat, on_done, timelines)
            runs.append(dataclasses.replace(run, cpu_busy_before=busy))
    return runs
