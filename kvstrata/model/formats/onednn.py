"""oneDNN's caches of compiled kernels, bounded.

oneDNN runs a float model's projections on CPU (`PackedLinear`) and torch's bf16 matmuls. It
compiles a kernel for every shape it is called with and keeps it in two LRU caches, its own
primitive cache and ideep's (torch's wrapper around it: `LRU_CACHE_CAPACITY`), 1,024 entries each by
default. A projection called with a row count it has not seen costs an entry of ~0.55 MiB of code,
whatever the projection's size, and a server sees new row counts all day: every step with a prefill
chunk has its own. That was the growth of issue 47: in a 20-minute soak of `kvstrata serve` (12
clients, 64 MiB device pool, a host tier and Redis) malloc's bytes in use went 396 -> 670 MiB
(Python's objects grew by ~7,600, mostly the bounded timeline store filling), RSS +15.8 MiB a minute
after the first third, and a loop of new row counts through the model's five projection shapes alone
took +460 MiB before both caches were full (pytorch/pytorch#98688 is the same growth, with the same
two variables as its cure).

`KERNEL_CACHE_ENTRIES` holds a busy decode's working set: each row count of a decode step is 5
entries (4 projection shapes shared by every layer, and the head), so 256 keep ~50 running batch
sizes while the prefill chunks' one-off shapes pass through, in ~140 MiB at most. Its cost is a
compile of a row count that fell out, ~1 ms on the 2-core EPYC: the soak's recorded calls replayed
through an LRU compiled 3,048 times in 2,432 steps instead of 1,394. The soaks before and after:
docs/design/model.md.
"""

from __future__ import annotations

import os

KERNEL_CACHE_ENTRIES = 256
# oneDNN's primitive cache, and ideep's cache of the primitives torch made through it.
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> None:
    """Cap both caches at `entries`, unless the environment already sets them.

    Each library reads its variable once, when it makes its first kernel, and keeps it for the life
    of the process: this must run before then, and a later call changes nothing. `kvstrata`'s main
    calls it first thing, and `PackedLinear.from_dense` before packing (processes that load a model
    without the command line: the `LLM` API, benchmarks)."""
    assert entries >= 1, "a cache of no entries compiles every call"
    for name in CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
