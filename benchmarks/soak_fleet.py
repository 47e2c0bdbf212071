"""The soak's processes: Redis, two engines behind `kvstrata router`, a P/D pair behind its own router.

Each is a named `Process` that a fault can SIGKILL and start again (a new incarnation, same flags and
port), whose resident memory is read from /proc and whose /metrics is scraped. The fleet's engines
share Redis; the P/D pair shares a disk store folder with a small budget (so it fills, and a fault
can corrupt it, fill it or make it read-only). Both routers are kvstrata's own.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvstrata.bench.fleets import redis_server

SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                          "prompt_lookup_min": 2})
METRIC = re.compile(r"^(kvstrata_\S+) (\S+)$")


@dataclass(frozen=True)
class Sizes:
    """Memory and queue sizes of every engine: small, so the tiers fill within the warm-up and stay full."""

    kv_cache: str = "48MiB"            # ~2,100 tokens of SmolLM2-135M in bf16
    host_cache: str = "64MiB"          # the host tier under pressure
    disk_budget_mib: int = 96          # the P/D pair's disk store
    redis_max: str = "192mb"           # allkeys-lru beyond it
    max_queue: int = 12
    max_model_len: int = 2048
    timelines_kept: int = 256          # full within the warm-up, as the tiers are (4,096 by default: ~9 MiB)
    kv_events_kept: int = 4096         # likewise (65,536 by default: ~10 MiB, full only after 23-41 min here)


@dataclass
class Process:
    """One process of the fleet, by name; `start` again after a kill is a new incarnation."""

    name: str
    argv: list[str]
    url: str | None                    # its HTTP base (engines and routers), None for Redis
    log: Path
    popen: subprocess.Popen | None = None
    incarnation: int = 0

    def start(self) -> None:
        assert self.popen is None or self.popen.poll() is not None, f"{self.name} is already running"
        with open(self.log, "a") as log:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        self.incarnation += 1

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs, as when the OOM killer or a power cut takes it."""
        assert self.popen is not None
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()

    def stop(self, grace_s: float = 60.0) -> int | None:
        if self.popen is None:
            return None
        self.popen.terminate()
        try:
            return self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def rss_mib(self) -> float | None:
        """Resident memory (VmRSS) of the live process, None when it is not running."""
        if not self.alive:
            return None
        try:
            status = Path(f"/proc/{self.popen.pid}/status").read_text()
        except OSError:
            return None
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        return int(match.group(1)) / 1024 if match else None

    def healthy(self) -> bool:
        if not self.alive:
            return False
        if self.url is None:
            return True
        try:
            return httpx.get(f"{self.url}/health", timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        """kvstrata_* samples of its /metrics ({} when it does not answer)."""
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
        except httpx.HTTPError:
            return {}
        return {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := METRIC.match(line))}


@dataclass
class Fleet:
    """Every process of the soak, and where their shared state lives."""

    processes: dict[str, Process]
    redis_url: str
    disk_store: Path
    fleet_router: str
    pd_router: str
    sizes: Sizes

    ENGINES = ("engine0", "engine1", "prefill", "decode")

    @classmethod
    def plan(cls, workdir: Path, port: int, sizes: Sizes) -> Fleet:
        """The processes, not started: routers on `port` and `port + 1`, engines on the next four, Redis at +9."""
        kvstrata = [sys.executable, "-m", "kvstrata"]
        redis_port, disk = port + 9, workdir / "pd-store"
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        engine_flags = ["--threads", "1", "--kv-cache-memory", sizes.kv_cache, "--host-cache-memory", sizes.host_cache,
                        "--max-queue", str(sizes.max_queue), "--max-model-len", str(sizes.max_model_len),
                        "--timelines-kept", str(sizes.timelines_kept), "--kv-events-kept", str(sizes.kv_events_kept),
                        "--batch-invariant", "--audit-every-step", "--speculative-config", SPECULATIVE,
                        "--log-level", "WARNING"]
        urls = {name: f"http://127.0.0.1:{port + 2 + i}" for i, name in enumerate(cls.ENGINES)}
        stores = {"engine0": ["--store", redis_url], "engine1": ["--store", redis_url],
                  "prefill": ["--store", "disk", "--store-path", str(disk), "--store-capacity",
                              f"{sizes.disk_budget_mib}MiB", "--disaggregation-mode", "prefill"],
                  "decode": ["--store", "disk", "--store-path", str(disk), "--store-capacity",
                             f"{sizes.disk_budget_mib}MiB", "--disaggregation-mode", "decode"]}
        log = lambda name: workdir / f"{name}.log"  # noqa: E731
        processes = {"redis": Process("redis", [redis_server(), "--port", str(redis_port), "--bind", "127.0.0.1",
                                                "--save", "", "--appendonly", "no", "--maxmemory", sizes.redis_max,
                                                "--maxmemory-policy", "allkeys-lru"], None, log("redis"))}
        for name in cls.ENGINES:
            processes[name] = Process(name, [*kvstrata, "serve", "--port", urls[name].rsplit(":", 1)[1],
                                             *engine_flags, *stores[name]], urls[name], log(name))
        fleet_router, pd_router = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
        processes["router"] = Process("router", [*kvstrata, "router", "--port", str(port), "--policy", "kv_aware",
                                                 "--engine", urls["engine0"], "--engine", urls["engine1"],
                                                 "--log-level", "INFO"], fleet_router, log("router"))
        processes["pd-router"] = Process("pd-router", [*kvstrata, "router", "--port", str(port + 1),
                                                       "--pd-disaggregation", "--prefill", urls["prefill"],
                                                       "--decode", urls["decode"], "--log-level", "INFO"],
                                         pd_router, log("pd-router"))
        return cls(processes, redis_url, disk, fleet_router, pd_router, sizes)

    def start(self, timeout_s: float = 300.0) -> None:
        for process in self.processes.values():
            process.start()
        self.wait_healthy(list(self.processes), timeout_s)

    def wait_healthy(self, names: list[str], timeout_s: float = 300.0) -> float:
        """Until every named process answers /health; seconds waited. A process that exits is an error."""
        started = time.monotonic()
        while not all(self.processes[name].healthy() for name in names):
            dead = [name for name in names if not self.processes[name].alive]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited; see {self.processes[dead[0]].log}")
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{', '.join(names)} not healthy in {timeout_s:.0f} s")
            time.sleep(0.5)
        return time.monotonic() - started

    def engines(self) -> list[Process]:
        return [self.processes[name] for name in self.ENGINES]

    def stop(self) -> dict[str, int | None]:
        """Terminate everything (routers first); each process's exit code."""
        order = ["router", "pd-router", *self.ENGINES, "redis"]
        return {name: self.processes[name].stop() for name in order}
