"""HeapTrimmer: glibc's malloc_trim once per interval, on the thread that ticks it (kvstrata.engine.heap_trim)."""

from __future__ import annotations

import asyncio
import ctypes
import sys
import threading

import pytest

from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine import async_engine
from kvstrata.engine.async_engine import AsyncLLMEngine
from kvstrata.engine.heap_trim import TRIM_INTERVAL, HeapTrimmer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_it_trims_once_per_interval_from_construction():
    clock, calls = Clock(), []
    heap = HeapTrimmer(interval=60.0, clock=clock, trim=lambda pad: calls.append(pad) or 1)
    assert not heap.tick()                  # not before a whole interval
    clock.now += 59.9
    assert not heap.tick()
    clock.now += 0.1
    assert heap.tick() and calls == [0]     # malloc_trim(0): keep no padding at the heap's top
    assert not heap.tick()
    clock.now += 59.0
    assert not heap.tick()
    clock.now += 120.0                      # an engine that was away long trims once, not once per interval missed
    assert heap.tick() and not heap.tick()
    assert heap.trims == len(calls) == 2


def test_without_malloc_trim_it_does_nothing():
    clock = Clock()
    heap = HeapTrimmer(interval=1.0, clock=clock)
    heap._trim = None                       # musl, macOS
    clock.now += 10
    assert not heap.tick() and heap.trims == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "malloc_trim"),
                    reason="glibc only")
def test_glibc_trims_for_real():
    clock = Clock()
    heap = HeapTrimmer(clock=clock)
    clock.now += TRIM_INTERVAL
    assert heap.tick() and heap.trims == 1


def test_the_engine_thread_ticks_it(make_engine, monkeypatch):
    ticked_on = []
    monkeypatch.setattr(async_engine.HeapTrimmer, "tick",
                        lambda self: ticked_on.append(threading.current_thread().name))
    engine = AsyncLLMEngine(make_engine()).start()
    try:
        async def main():
            return [o async for o in engine.generate("Hi", SamplingParams(max_tokens=2))]

        assert asyncio.run(main())[-1].finished
    finally:
        engine.shutdown()
    assert ticked_on and set(ticked_on) == {"kvstrata-engine"}


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc's mallinfo2 (2.33+)")
def test_heap_stats_see_a_held_allocation_in_use_and_its_release():
    from kvstrata.engine.heap_trim import heap_stats

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = heap_stats()
    held = libc.malloc(64 << 20)
    assert heap_stats().in_use - before.in_use >= 64 << 20
    libc.free(held)
    assert heap_stats().in_use - before.in_use < 8 << 20


MMAP_SCRIPT = """
import ctypes, sys
sys.path.insert(0, {root!r})
from kvstrata.engine.heap_trim import _MallInfo2, pin_mmap_threshold
pinned = pin_mmap_threshold(1 << 20, environ={{}}) if {pin!r} else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = _MallInfo2
libc.free(libc.malloc(8 << 20))          # freeing a mapped 8 MiB raises glibc's own threshold past it
before = libc.mallinfo2().hblks
held = libc.malloc(2 << 20)
print(pinned, libc.mallinfo2().hblks - before)    # 1 if the 2 MiB got a mapping of its own
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc's mallopt and mallinfo2")
@pytest.mark.parametrize("pin", [False, True])
def test_a_pinned_mmap_threshold_keeps_big_buffers_out_of_the_heap(pin):
    import subprocess
    from pathlib import Path

    script = MMAP_SCRIPT.format(root=str(Path(__file__).resolve().parents[2]), pin=pin)
    done = subprocess.run([sys.executable, "-c", script], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=60, check=True)
    pinned, mapped = done.stdout.split()
    assert (pinned, int(mapped)) == (str(pin), int(pin))     # glibc's default carves it from the heap


def test_an_operators_malloc_mmap_threshold_wins():
    from kvstrata.engine.heap_trim import pin_mmap_threshold

    assert pin_mmap_threshold(1 << 20, environ={"MALLOC_MMAP_THRESHOLD_": "131072"}) is False
