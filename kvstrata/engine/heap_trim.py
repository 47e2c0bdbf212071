"""Freed memory handed back to the OS once a minute: glibc's `malloc_trim(0)` on the engine thread.

glibc's malloc keeps what a process frees for its own reuse, and gives memory back to the OS only
from the top of a heap. A server frees in the middle of its heaps all day: oneDNN's kernels that
leave their bounded cache (kvstrata.model.onednn), store records queued while Redis was down, a
step's activations of a size no later step asks for. In a 20-minute soak of `kvstrata serve` with
the kernel caches bounded (issue 47), malloc's bytes in use held at ~510 MiB while its free bytes
went 140 -> 227 MiB, and RSS with them: +6.8 MiB a minute. `malloc_trim(0)` releases the free
pages however deep in a heap they lie (madvise), so RSS follows what is in use; the figures with
it are in docs/design/model.md. A trim took 1-5 ms on the busy 2-core EPYC: once a minute, it
is ~0.01% of a busy engine's time, and the pages it released cost a page fault when reused.

Where the C library has no `malloc_trim` (musl, macOS) nothing happens. `heap_stats` reads glibc's
own figures (mallinfo2) for /metrics, so a long run tells a leak (bytes in use growing) from
fragmentation (free bytes growing) from memory outside malloc (RSS growing with neither).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

TRIM_INTERVAL = 60.0        # seconds between trims, busy or idle (see the docstring for the cost)


class HeapTrimmer:
    """Trims at most once per `interval` seconds, on the thread that calls `tick` (the engine's)."""

    def __init__(self, interval: float = TRIM_INTERVAL, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[int], int] | None = None):
        self.interval, self.clock = interval, clock
        self._trim = trim if trim is not None else _malloc_trim()
        self._due = clock() + interval
        self.trims = 0

    def tick(self) -> bool:
        """Trim if `interval` has passed since the last trim (or since construction); whether it did."""
        now = self.clock()
        if self._trim is None or now < self._due:
            return False
        self._trim(0)
        self._due = now + self.interval
        self.trims += 1
        return True


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


@dataclass(frozen=True)
class HeapStats:
    """glibc malloc's bytes: handed out (in_use, mmapped chunks included), and held free in its heaps."""

    in_use: int
    free: int


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_stats() -> HeapStats | None:
    """malloc's figures for the whole process (every arena), or None without glibc's mallinfo2 (2.33+)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return HeapStats(in_use=info.uordblks + info.hblkhd, free=info.fordblks)
