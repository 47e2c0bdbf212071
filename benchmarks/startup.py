"""How long `kvstrata serve` takes from launch to its first 200 on /health, and its imports.

    .venv/bin/python benchmarks/startup.py                          # 3 warm starts + 1 cold, make-serve flags
    .venv/bin/python benchmarks/startup.py --baseline /work/main    # the same, interleaved with another checkout

Warm: the GGUF is already converted (the cache under $KVSTRATA_CACHE_DIR or ~/.cache/kvstrata).
Cold: a fresh cache folder, so the start includes the one-time conversion. `cpu` is the server
process's user + system CPU seconds at that moment (steadier than wall time when others load the
cores). Imports: the cumulative `python -X importtime` of what `kvstrata serve` imports before it
loads the model. Each start gets a fresh store folder, so nothing is restored. The machine is shared: runs of two checkouts alternate,
and the report gives every run and the median.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

FLAGS = ("--host-cache-memory", "1GiB", "--store", "disk")       # `make serve`
SERVE_IMPORTS = "import kvstrata.entrypoints.cli.main, uvicorn, kvstrata.engine.async_engine, kvstrata.entrypoints.openai.api_server"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(checkout: Path, cache: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    if cache is not None:
        env["KVSTRATA_CACHE_DIR"] = str(cache)
    return env


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux): less swayed by other jobs than wall time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_to_ready(checkout: Path, cache: Path | None, timeout: float = 300.0) -> tuple[float, float]:
    """(wall, CPU) seconds from launch to the first 200 on /health; the server is then stopped (SIGTERM)."""
    port, store = _free_port(), tempfile.mkdtemp(prefix="startup-store-")
    command = [sys.executable, "-m", "kvstrata", "serve", *FLAGS, "--store-path", store, "--port", str(port)]
    started = time.monotonic()
    proc = subprocess.Popen(command, env=_env(checkout, cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - started < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{checkout}: the server exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.monotonic() - started, _cpu_seconds(proc.pid)
            except httpx.TransportError:
                time.sleep(0.02)
        raise RuntimeError(f"{checkout}: not ready after {timeout:.0f}s")
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        shutil.rmtree(store, ignore_errors=True)


def import_seconds(checkout: Path) -> float:
    """Cumulative import time of the top-level modules `kvstrata serve` imports (python -X importtime)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", SERVE_IMPORTS], env=_env(checkout, None),
                         capture_output=True, text=True, check=True).stderr
    return sum(int(m.group(1)) for m in re.finditer(r"^import time:\s+\d+ \|\s+(\d+) \| \S", out, re.M)) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", default=str(Path(__file__).resolve().parent.parent),
                        help="the kvstrata checkout to measure (default: this one)")
    parser.add_argument("--baseline", default=None, help="another checkout, measured in alternation")
    parser.add_argument("--warm", type=int, default=3, help="warm starts per checkout (default: 3)")
    parser.add_argument("--cold", type=int, default=1, help="cold starts per checkout (default: 1)")
    parser.add_argument("--imports", type=int, default=5, help="import timings per checkout (default: 5)")
    args = parser.parse_args()
    checkouts = [Path(args.checkout)] + ([Path(args.baseline)] if args.baseline else [])
    figures: dict[str, dict[str, list[float]]] = {
        str(c): {kind: [] for kind in ("import", "warm", "warm cpu", "cold", "cold cpu")} for c in checkouts}
    for _ in range(args.imports):
        for checkout in checkouts:
            figures[str(checkout)]["import"].append(import_seconds(checkout))
    time_to_ready(checkouts[0], None)            # converts the model once if needed: warm means warm
    for _ in range(args.warm):
        for checkout in checkouts:
            wall, cpu = time_to_ready(checkout, None)
            figures[str(checkout)]["warm"].append(wall)
            figures[str(checkout)]["warm cpu"].append(cpu)
    for _ in range(args.cold):
        for checkout in checkouts:
            cache = Path(tempfile.mkdtemp(prefix="startup-cache-"))
            try:
                wall, cpu = time_to_ready(checkout, cache)
                figures[str(checkout)]["cold"].append(wall)
                figures[str(checkout)]["cold cpu"].append(cpu)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"start to first 200 on /health, `kvstrata serve {' '.join(FLAGS)}` (load average {load:.1f}, "
          f"{os.cpu_count()} cores)")
    for checkout, kinds in figures.items():
        for kind, values in kinds.items():
            if values:
                runs = " ".join(f"{v:.2f}" for v in values)
                print(f"  {checkout:<32} {kind:<8} median {statistics.median(values):6.2f} s   runs: {runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
