"""The soak's faults, on a schedule, each with its window logged.

A fault is something a real deployment meets: Redis dies and comes back empty; a record rots in
Redis and on disk; the disk store's folder fills to its budget and turns read-only for a while; an
engine behind the router is SIGKILLed and started again by its supervisor; a P/D decode engine dies
while a handoff is in flight. Each `Window` spans from the fault's start to the moment its effect
has passed (the process healthy again, the folder writable again), so a failed request can be
attributed to a fault or not. The host tier is under pressure the whole run (a small
`--host-cache-memory`, soak_fleet.Sizes): that is the setting, not a window.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import redis

from soak_fleet import Fleet

logger = logging.getLogger("soak")
RECORD_SUFFIX = ".kvr"


@dataclass
class Window:
    fault: str
    start: float                       # wall-clock seconds (matched against the routers' logs)
    end: float | None = None
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Fault:
    name: str
    at: float                          # share of the traffic's duration when it starts
    hold: float = 0.0                  # share of the duration it lasts (for the faults that last)


# Process kills come early, so every process has run its own warm-up before the memory slope is measured.
SCHEDULE = (Fault("redis-kill", 0.10, 0.05), Fault("engine-kill", 0.18), Fault("decode-kill-mid-handoff", 0.26),
            Fault("store-corruption", 0.50, 0.03), Fault("disk-full-read-only", 0.60, 0.08))
WARMUP = 0.40                          # share of the duration after which resident memory should be flat


@dataclass
class Faults:
    """Runs SCHEDULE against `fleet` in a thread over `duration_s` from `origin`; fills `windows`."""

    fleet: Fleet
    duration_s: float
    seed: int
    windows: list[Window] = field(default_factory=list)

    def run(self, origin: float, stop: threading.Event) -> None:
        actions: dict[str, Callable[[Window, float], None]] = {
            "redis-kill": self.redis_kill, "engine-kill": self.engine_kill,
            "decode-kill-mid-handoff": self.decode_kill, "store-corruption": self.corrupt,
            "disk-full-read-only": self.fill_and_freeze}
        for fault in SCHEDULE:
            if stop.wait(max(0.0, origin + fault.at * self.duration_s - time.time())):
                return
            window = Window(fault.name, time.time())
            self.windows.append(window)
            logger.info("fault: %s", fault.name)
            try:
                actions[fault.name](window, fault.hold * self.duration_s)
            except Exception as exc:     # a fault that could not be applied is reported, never silent
                window.detail["error"] = repr(exc)
            window.end = time.time()
            logger.info("fault over: %s after %.1f s %s", fault.name, window.end - window.start, window.detail)

    def redis_kill(self, window: Window, hold_s: float) -> None:
        redis_process = self.fleet.processes["redis"]
        redis_process.kill()
        time.sleep(hold_s)
        redis_process.start()
        self.fleet.wait_healthy(["redis"], 60)
        window.detail["down_s"] = round(hold_s, 1)

    def engine_kill(self, window: Window, _hold_s: float) -> None:
        engine = self.fleet.processes["engine1"]
        engine.kill()
        engine.start()
        window.detail["back_after_s"] = round(self.fleet.wait_healthy(["engine1", "router"]), 1)

    def decode_kill(self, window: Window, _hold_s: float) -> None:
        """A long prompt to the P/D router, and the decode engine SIGKILLed while its handoff is in flight."""
        answer: dict = {}

        def handoff() -> None:
            body = {"model": "SmolLM2-135M-Instruct", "prompt": "The harbour ledger. " * 300, "max_tokens": 16,
                    "temperature": 0}
            try:
                answer["status"] = httpx.post(f"{self.fleet.pd_router}/v1/completions", json=body,
                                              timeout=300).status_code
            except httpx.HTTPError as exc:
                answer["status"] = f"transport: {type(exc).__name__}"

        request = threading.Thread(target=handoff)
        request.start()
        time.sleep(0.5)
        decode = self.fleet.processes["decode"]
        decode.kill()
        decode.start()
        window.detail["back_after_s"] = round(self.fleet.wait_healthy(["decode", "pd-router"]), 1)
        request.join(300)
        window.detail["handoff_request"] = answer.get("status")

    def corrupt(self, window: Window, hold_s: float) -> None:
        """Flip bytes in the middle of a few records in Redis and in the P/D pair's disk store."""
        rng = random.Random(self.seed)
        client = redis.Redis.from_url(self.fleet.redis_url)
        keys = sorted(client.scan_iter(count=500))[:2000]
        flipped = 0
        for key in rng.sample(keys, min(8, len(keys))):
            value = client.get(key)
            if value:
                client.set(key, flip(value))
                flipped += 1
        window.detail["redis_records"] = flipped
        records = sorted(self.fleet.disk_store.rglob(f"*{RECORD_SUFFIX}"))
        for path in rng.sample(records, min(8, len(records))):
            try:
                path.write_bytes(flip(path.read_bytes()))
            except OSError:
                continue                 # swept away meanwhile
        window.detail["disk_records"] = min(8, len(records))
        time.sleep(hold_s)

    def fill_and_freeze(self, window: Window, hold_s: float) -> None:
        """Fill the disk store's folder to its budget with junk records, make it read-only for `hold_s`."""
        budget = self.fleet.sizes.disk_budget_mib << 20
        used = sum(p.stat().st_size for p in self.fleet.disk_store.rglob("*") if p.is_file())
        rng = random.Random(self.seed + 1)
        filler, chunk = 0, 1 << 20
        while used + filler + chunk <= budget:
            name = rng.randbytes(16).hex()
            (self.fleet.disk_store / name[:2] / f"{name}{RECORD_SUFFIX}").write_bytes(rng.randbytes(chunk))
            filler += chunk
        window.detail["filler_mib"] = filler >> 20          # 0 when traffic had already filled it
        window.detail["store_mib"], window.detail["budget_mib"] = (used + filler) >> 20, budget >> 20
        shards = [p for p in self.fleet.disk_store.iterdir() if p.is_dir()]
        for shard in shards:
            os.chmod(shard, 0o555)
        try:
            time.sleep(hold_s)
        finally:
            for shard in shards:
                os.chmod(shard, 0o755)


def flip(record: bytes) -> bytes:
    """The record with 16 bytes in its middle inverted: a checksum failure, never a silent change."""
    middle = len(record) // 2
    return record[:middle] + bytes(b ^ 0xFF for b in record[middle:middle + 16]) + record[middle + 16:]
