"""The roofline of CPU decoding: bytes of weights a step reads, and what the memory system gives.

A decode step reads every weight once whatever the batch size, so weight bytes x steps / time is
the bandwidth a run achieved; beside the machine's measured read bandwidth it says how far from
the limit the engine runs (gpt-fast prints the same figure).
"""

from __future__ import annotations

import time

import torch

BANDWIDTH_BUFFER_BYTES = 512 * 1024**2     # far past any last-level cache of this machine kind


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every projection (int8 ones at their int8 size), the LM
    head and the norms; the embedding lookup reads a few rows only."""
    return model.step_weight_bytes()


def memory_read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second torch reads from a buffer larger than the caches (best of `repeats`), on
    torch's current thread count, i.e. the same threads the engine decodes with."""
    buffer = torch.ones(BANDWIDTH_BUFFER_BYTES // 4, dtype=torch.float32)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BUFFER_BYTES / best
