"""The store protocol every store keeps, and what the stores share: errors, counters, a circuit breaker.

A record is opaque here (its format and checks are `kvstrata.kvcache.stores.records`) but for its
length, which its header declares: a store keeps bytes under keys, in batches, manages its own capacity,
and reads a value whole only once it is a record of its declared length (`refusal`), so a foreign value
(a link to a file outside the folder, a sparse giant) is a miss, never read. Two implementations of one protocol:

* `DiskStore`  the embedded default: one file per block under a folder, a byte budget with LRU deletion.
* `RedisStore` for engines sharing a cache: pipelined batches, a circuit breaker, Redis's own eviction.
  (`RedisClusterStore`, in kvstrata.kvcache.stores.redis_cluster, is the same over a Redis Cluster.)

Contract for the caller (the tier manager): every operation either returns or raises `StoreError`,
whose `kind` ("timeout", "connection", "io", "full", "server", "closed", "internal") is a metric label.
A failed get is a miss, a failed put a dropped write; nothing else ever escapes a store. Every method
is safe to call from several threads at once, and a `DiskStore` folder or a Redis database may be
shared by several engine processes: no store assumes that what `exists` said still holds at `get`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvstrata.kvcache.stores.records import RecordError, declared_size

logger = logging.getLogger(__name__)

REDIS_PREFIX = "kvstrata:"
BREAKER_COOLDOWN_S = 1.0


class StoreError(Exception):
    """A store operation that did not happen; `kind` says why, for metrics and logs."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass
class StoreStats:
    """Counters since the store was opened (this process only). Counts are of keys, not batches."""

    reads: int = 0              # keys asked of get(): hits + misses + keys of failed gets
    hits: int = 0
    misses: int = 0
    writes: int = 0             # records stored by put()
    bytes_read: int = 0
    bytes_written: int = 0
    deletions: int = 0          # records removed by delete()
    evictions: int = 0          # records removed to keep within the byte budget (disk only)
    refused: int = 0            # values get() did not read: not a record of its length (misses; removed)
    errors: dict[str, int] = field(default_factory=dict)   # failed operations by StoreError.kind


class Store(Protocol):
    """Block hash -> record, batched. Thread-safe; raises only StoreError."""

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has a record now (it may be gone by the time it is read)."""

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's record, or None where there is none."""

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store (key, record) pairs, replacing what a key held."""

    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove these keys' records (a record that failed its checks, a reset); absent keys are fine."""

    def stats(self) -> StoreStats:
        """A snapshot of the counters."""

    def close(self) -> None:
        """Release connections; later calls raise StoreError("closed")."""


@dataclass
class Counters:
    """StoreStats behind a lock: stores are called from a thread pool."""

    stats: StoreStats = field(default_factory=StoreStats)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def error(self, kind: str) -> None:
        with self.lock:
            self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1

    def snapshot(self) -> StoreStats:
        with self.lock:
            return replace(self.stats, errors=dict(self.stats.errors))


def store_error(exc: Exception) -> StoreError:
    """The StoreError for any failure below a store, so callers handle exactly one exception type."""
    if isinstance(exc, StoreError):
        return exc
    redis = sys.modules.get("redis")         # imported by RedisStore only: absent, no error is redis's
    if isinstance(exc, TimeoutError) or (redis and isinstance(exc, redis.TimeoutError)):
        return StoreError("timeout", str(exc))
    if redis and isinstance(exc, redis.ConnectionError):
        return StoreError("connection", str(exc))
    if (redis and isinstance(exc, redis.OutOfMemoryError)) or getattr(exc, "errno", None) in (errno.ENOSPC,
                                                                                            errno.EDQUOT):
        return StoreError("full", str(exc))
    if redis and isinstance(exc, redis.RedisError):
        return StoreError("server", str(exc))
    if isinstance(exc, OSError):
        return StoreError("io", str(exc))
    logger.exception("unexpected error in a store operation")
    return StoreError("internal", f"{type(exc).__name__}: {exc}")


def refusal(head: bytes, size: int) -> str | None:
    """Why a value of `size` bytes that begins with `head` (its first HEADER.size bytes) must not be read
    whole, as a RecordError reason ("length", "magic", "version"); None for a record of its declared
    length. A reason and never the value's bytes goes into a log line: the value may be anyone's file."""
    try:
        return None if declared_size(head) == size else "length"
    except RecordError as exc:
        return exc.reason


@contextlib.contextmanager
def guard(counters: Counters, closed: bool, failed_reads: int = 0) -> Iterator[None]:
    """Run one store operation: refuse it after close, turn any failure into a counted StoreError."""
    if closed:
        counters.error("closed")
        raise StoreError("closed", "the store is closed")
    try:
        yield
    except Exception as exc:
        error = store_error(exc)
        counters.error(error.kind)
        counters.add(reads=failed_reads)
        raise error from exc


@dataclass
class Breaker:
    """Fail fast for `cooldown_s` after a connection failure instead of waiting on a timeout per call.

    When the cooldown ends, one call goes through as a probe (others keep failing fast until it
    settles); success closes the breaker, failure opens it for another cooldown.
    """

    cooldown_s: float = BREAKER_COOLDOWN_S
    failed: bool = False
    open_until: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self) -> None:
        with self.lock:
            if not self.failed:
                return
            now = time.monotonic()
            if now < self.open_until:
                raise StoreError("connection", f"redis unreachable; next try in {self.open_until - now:.1f} s")
            self.open_until = now + self.cooldown_s             # this call is the probe

    def succeeded(self) -> None:
        with self.lock:
            self.failed = False

    def tripped(self) -> None:
        with self.lock:
            self.failed = True
            self.open_until = time.monotonic() + self.cooldown_s
