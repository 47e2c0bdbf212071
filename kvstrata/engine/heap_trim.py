"""Freed memory handed back to the OS once a minute: glibc's `malloc_trim(0)` on the engine thread.

glibc's malloc keeps what a process frees for its own reuse, and gives memory back to the OS only
from the top of a heap. A server frees in the middle of its heaps all day: oneDNN's kernels that
leave their bounded cache (kvstrata.model.formats.onednn), store records queued while Redis was down, a
step's activations of a size no later step asks for. In a 20-minute soak of `kvstrata serve` with
the kernel caches bounded (issue 47), malloc's bytes in use held at ~510 MiB while its free bytes
went 140 -> 227 MiB, and RSS with them: +6.8 MiB a minute. `malloc_trim(0)` releases the free
pages however deep in a heap they lie (madvise), so RSS follows what is in use; the figures with
it are in docs/design/model.md. A trim took 1-5 ms on the busy 2-core EPYC: once a minute, it
is ~0.01% of a busy engine's time, and the pages it released cost a page fault when reused.

Trims alone left the 30-minute soak (benchmarks/soak.py, BENCHMARKS.md) growing 0.5-2.3 MiB a minute,
malloc's bytes in use flat and its free bytes rising. glibc serves a request of at least its mmap
threshold with a mapping of its own, returned whole on free; but the threshold starts at 128 KiB and
rises to the size of every such mapping freed, up to 32 MiB, so after the first steps a step's
activations, logits and store records of every size are carved from the heaps, and the long-lived
small chunks allocated between them pin their pages. `pin_mmap_threshold` fixes the threshold at
MMAP_THRESHOLD before the server starts (an operator's MALLOC_MMAP_THRESHOLD_ wins): the soak's engines
then grew 0.2-1.1 MiB a minute, at ~3% of offline throughput; at 256 KiB a prefill's activations each
paid a mapping and its page faults (-30%).

Where the C library has no `malloc_trim` (musl, macOS) nothing happens. `heap_stats` reads glibc's
own figures (mallinfo2) for /metrics, so a long run tells a leak (bytes in use growing) from
fragmentation (free bytes growing) from memory outside malloc (RSS growing with neither).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

TRIM_INTERVAL = 60.0        # seconds between trims, busy or idle (see the docstring for the cost)
MMAP_THRESHOLD = 4 << 20    # bytes: a request this big or bigger gets a mapping of its own
M_MMAP_THRESHOLD = -3       # mallopt's parameter number (glibc's malloc.h)


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD, environ: Mapping[str, str] = os.environ) -> bool:
    """Fix glibc's mmap threshold at `threshold` (it stops rising); whether it was set here. An operator's
    MALLOC_MMAP_THRESHOLD_ wins; nothing happens without glibc's mallopt."""
    mallopt = _glibc("mallopt")
    if "MALLOC_MMAP_THRESHOLD_" in environ or mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1


def _glibc(name: str) -> Callable | None:
    """The C library's function `name`, or None where it has none (musl, macOS, an older glibc)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):
        return None


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
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


@dataclass(frozen=True)
class HeapStats:
    """malloc's bytes: handed out (in_use, glibc's mmapped chunks included), and held beyond that (free)."""

    in_use: int
    free: int


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_stats() -> HeapStats | None:
    """malloc's figures for the whole process (every arena): jemalloc's where it is preloaded (`kvstrata
    serve --allocator`: handed out, and resident beyond that), else glibc's; None without either."""
    jemalloc = _jemalloc_stats()
    if jemalloc is not None:
        return jemalloc
    mallinfo2 = _glibc("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return HeapStats(in_use=info.uordblks + info.hblkhd, free=info.fordblks)


def _jemalloc_stats() -> HeapStats | None:
    """jemalloc's stats.allocated and stats.resident - stats.allocated, refreshed; None where it is not loaded."""
    mallctl = _glibc("mallctl")
    if mallctl is None:
        return None
    mallctl.restype = ctypes.c_int
    epoch, size = ctypes.c_uint64(1), ctypes.c_size_t(8)
    mallctl(b"epoch", ctypes.byref(epoch), ctypes.byref(size), ctypes.byref(epoch), size)
    values = {}
    for name in ("stats.allocated", "stats.resident"):
        value, size = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
        if mallctl(name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
            return None
        values[name] = value.value
    return HeapStats(in_use=values["stats.allocated"], free=values["stats.resident"] - values["stats.allocated"])
