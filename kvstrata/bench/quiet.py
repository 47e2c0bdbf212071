"""Wait for a quiet machine before a measurement (stdlib only: the peers' scripts use it too).

On a shared 2-core machine, two compute threads collapse when a third process takes a core: each
OpenMP barrier waits for a thread that is not running, and a 1 ms matmul takes 15 ms. So every
timed repeat first waits, up to `patience` seconds, until the cores are nearly idle, and records
how busy they were, so a figure measured beside a neighbour can be told from a clean one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)

BUSY_LIMIT = 0.25     # share of all cores others may use while we measure


def cpu_busy(seconds: float = 0.5) -> float:
    """Share of all cores busy over `seconds`, whoever uses them (0.0 where /proc/stat is missing)."""
    stat = Path("/proc/stat")
    if not stat.exists():
        return 0.0

    def sample() -> tuple[int, int]:
        values = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:]]
        return values[3] + values[4], sum(values)
    idle0, total0 = sample()
    time.sleep(seconds)
    idle1, total1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_quiet(patience: float, what: str = "measurement") -> float:
    """Wait until the cores are at most BUSY_LIMIT busy or `patience` seconds passed; the last reading
    (taken even with no patience, so every figure carries it)."""
    start = time.monotonic()
    busy = cpu_busy()
    while busy > BUSY_LIMIT and time.monotonic() - start < patience:
        logger.warning("%s: the machine is %.0f%% busy with other jobs; waiting", what, 100 * busy)
        time.sleep(4.0)
        busy = cpu_busy()
    return round(busy, 3)
