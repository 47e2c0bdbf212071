"""Stores: the KV tier below host memory, mapping a block hash (16 bytes) to one record.

A record is opaque here (its format and checks are `kvstrata.kvcache.records`); a store only keeps
bytes under keys, in batches, and manages its own capacity. Two implementations of one protocol:

* `DiskStore`  the embedded default: one file per block under a folder, a byte budget with LRU deletion.
* `RedisStore` for engines sharing a cache: pipelined batches, a circuit breaker, Redis's own eviction.
  (`RedisClusterStore`, in kvstrata.kvcache.redis_cluster, is the same over a Redis Cluster.)

Contract for the caller (the tier manager): every operation either returns or raises `StoreError`,
whose `kind` ("timeout", "connection", "io", "full", "server", "closed", "internal") is a metric label.
A failed get is a miss, a failed put a dropped write; nothing else ever escapes a store. Every method
is safe to call from several threads at once, and a `DiskStore` folder or a Redis database may be
shared by several engine processes: no store assumes that what `exists` said still holds at `get`.

Disk layout, chosen by measurement: `bench/disk_layout.py` (500 records of 0.74 MB, batches of 16,
median of 2 rounds) on the dev VM (ext4 on virtio, 2 shared cores). MB/s, one run, then the range
over three runs on different loads:

                 put (page cache)    put + os.sync      get warm           get cold (fadvise DONTNEED)
    files         720 (445-1318)      468 (323-660)     1877 (1494-2216)    517 (423-517)
    segments     2962 (2393-2962)    1222 (1053-1222)   2150 (1769-2150)    604 (465-604)
    DiskStore     713 (483-1378)      475 (350-643)     1794 (1630-1812)    463 (463-509)
    (tmpfs, --records 200: put files 1237, segments 1567; gets within 10% of each other)

Gets, the path a request waits on, are within 1.0-1.2x. Segments put 2-6x faster here because
creating a file costs 0.5-1.9 ms of kernel CPU on this VM's ext4 (0.02 ms on tmpfs, where the put
gap is 1.3x). A file per block still sustains 440-900 records/s here (7,000-14,000 tokens/s of the
default model's fp32 KV), from puts that run off the step loop. That does not buy what segments
would cost: compaction to delete single blocks (LRU), a shared index with cross-process locking for
two engines on one folder, index recovery after a crash. Files give all of it for free (atomic
os.replace, unlink, no shared state), which is what peers' file tiers got wrong (peers.md §4 items
20 and 28). Callers should check `exists` before encoding a block to put: a rewrite costs a create.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from kvstrata.config import cache_dir

logger = logging.getLogger(__name__)
T = TypeVar("T")

RECORD_SUFFIX = ".kvr"
TEMP_PREFIX = ".tmp-"
STALE_TEMP_S = 300.0          # a temp file this old is a crashed writer's, not one in progress
SWEEP_TO = 0.9                # a sweep deletes down to this share of the budget (amortizes the scan)
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
class _Counters:
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


def _store_error(exc: Exception) -> StoreError:
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


@contextlib.contextmanager
def _guard(counters: _Counters, closed: bool, failed_reads: int = 0) -> Iterator[None]:
    """Run one store operation: refuse it after close, turn any failure into a counted StoreError."""
    if closed:
        counters.error("closed")
        raise StoreError("closed", "the store is closed")
    try:
        yield
    except Exception as exc:
        error = _store_error(exc)
        counters.error(error.kind)
        counters.add(reads=failed_reads)
        raise error from exc


class DiskStore:
    """One file per block in a local folder, within a byte budget, least recently read deleted first.

        <root>/<first hash byte, 2 hex>/<hash, 32 hex>.kvr     a record, whole: written to a temp file
        <root>/<shard>/.tmp-XXXXXXXX                           in the same folder, then os.replace'd

    Recency is the file's mtime: a put sets it, a hit touches it (os.utime). The budget is kept by
    sweeps: this process adds what it writes to an estimate of the folder's size; the put that takes
    it past the budget runs one scan of the folder, which learns the true size (other engines' writes
    included), deletes the oldest records down to SWEEP_TO of the budget and removes stale temp files.
    A scan is paid once per (1 - SWEEP_TO) of the budget written, and with one engine the folder is
    within budget whenever no put is in progress. With P engines on one folder, each sees the others'
    writes only at its own sweeps, so the folder may exceed the budget by up to (P - 1) * (1 - SWEEP_TO) of it.

    No fsync: the store is a cache. A record torn by a power loss fails its checksum on load and is
    deleted by the caller, as any bad record is.
    """

    def __init__(self, path: str, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"a disk store needs a positive byte budget, not {capacity_bytes}")
        self.root = Path(path).expanduser()
        self.capacity_bytes = capacity_bytes
        self._counters = _Counters()
        self._closed = False
        self._usage_lock = threading.Lock()
        self._sweep_lock = threading.Lock()
        self._usage = 0             # estimate of the folder's bytes: true at the last sweep, plus our puts since
        self._written = 0           # bytes this process ever put: a sweep adds what was written while it scanned
        try:
            for shard in range(256):
                (self.root / f"{shard:02x}").mkdir(parents=True, exist_ok=True)
            self._sweep()
        except OSError as exc:
            raise ValueError(f"cannot use {self.root} as a disk store: {exc}") from exc
        logger.info("disk store at %s: %.1f of %.1f GB used", self.root, self._usage / 1e9, capacity_bytes / 1e9)

    def _path(self, key: bytes) -> Path:
        return self.root / key[:1].hex() / f"{key.hex()}{RECORD_SUFFIX}"

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with _guard(self._counters, self._closed):
            return [self._path(key).is_file() for key in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with _guard(self._counters, self._closed, failed_reads=len(keys)):
            records = [self._read(key) for key in keys]
        found = [record for record in records if record is not None]
        self._counters.add(reads=len(keys), hits=len(found), misses=len(keys) - len(found),
                           bytes_read=sum(len(record) for record in found))
        return records

    def _read(self, key: bytes) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                record = f.readall()
        except FileNotFoundError:
            return None
        with contextlib.suppress(FileNotFoundError):   # deleted meanwhile by another engine: still a hit
            os.utime(path)
        return record

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        with _guard(self._counters, self._closed):
            for key, record in items:
                self._write(self._path(key), record)
                self._counters.add(writes=1, bytes_written=len(record))
                with self._usage_lock:
                    self._usage += len(record)
                    self._written += len(record)
                    over = self._usage > self.capacity_bytes
                if over:
                    with self._sweep_lock:          # one sweep at a time; puts over the budget wait for it
                        if self._usage > self.capacity_bytes:      # unless the sweep we waited for did it
                            self._sweep()

    def _write(self, path: Path, record: bytes) -> None:
        try:
            fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
        except FileNotFoundError:           # the folder was removed under us (a user clearing the cache)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
        try:
            with open(fd, "wb") as f:
                f.write(record)
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise

    def delete(self, keys: Sequence[bytes]) -> None:
        with _guard(self._counters, self._closed):
            for key in keys:
                freed = self._unlink(self._path(key))
                if freed is not None:
                    self._counters.add(deletions=1)
                    with self._usage_lock:
                        self._usage -= freed

    @staticmethod
    def _unlink(path: Path) -> int | None:
        """Bytes freed by removing `path`, or None if it was already gone."""
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return None
        return size

    def _sweep(self) -> None:
        """Learn the folder's true size, delete least recently read records down to SWEEP_TO of the
        budget, remove temp files of crashed writers."""
        with self._usage_lock:
            written_before = self._written
        now = time.time()
        records: list[tuple[float, int, str]] = []           # (mtime, size, path)
        total = 0
        for shard in os.scandir(self.root):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(shard.path):
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:                      # removed by another engine meanwhile
                    continue
                if entry.name.endswith(RECORD_SUFFIX):
                    records.append((info.st_mtime, info.st_size, entry.path))
                    total += info.st_size
                elif entry.name.startswith(TEMP_PREFIX):
                    if now - info.st_mtime > STALE_TEMP_S:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)
                        logger.info("removed a crashed writer's temp file %s", entry.path)
                    else:
                        total += info.st_size
        evicted = 0
        if total > self.capacity_bytes:
            target = int(self.capacity_bytes * SWEEP_TO)
            records.sort()
            for _, size, path in records:
                if total <= target:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                total -= size
                evicted += 1
            logger.debug("disk store sweep evicted %d records", evicted)
        self._counters.add(evictions=evicted)
        with self._usage_lock:
            self._usage = total + self._written - written_before

    def stats(self) -> StoreStats:
        return self._counters.snapshot()

    def close(self) -> None:
        self._closed = True


@dataclass
class _Breaker:
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


class RedisStore:
    """Records in a Redis database shared by engines, under `kvstrata:<hash hex>`.

    Capacity is Redis's: run it with a memory limit and LRU eviction, e.g.
    `redis-server --maxmemory 20gb --maxmemory-policy allkeys-lru`; with the default `noeviction`
    policy a full Redis refuses puts (StoreError("full")) while keeping old records forever.

    Each batch is one round trip (MGET, a pipeline of EXISTS or SET, one DEL). Timeouts bound every
    socket wait, and nothing is retried: after a connection failure or a timeout the breaker makes
    calls fail fast for a second, then lets one through. A Redis restart between calls costs nothing:
    redis-py replaces a pooled connection the server closed when it hands it out. The redis-py
    client and its connection pool are thread-safe.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"a store timeout must be positive, not {timeout_s}")
        import redis                     # here, so a server without Redis never pays for the import
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        parts = urlsplit(url)
        self.address = f"{parts.hostname}:{parts.port or 6379}{parts.path}"     # for logs: no password
        self._redis = redis
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0))          # not redis-py's 3 backed-off retries: the breaker decides
        self._counters = _Counters()
        self._breaker = _Breaker()
        self._closed = False
        try:
            self._call(self._client.ping)
            logger.info("redis store at %s", self.address)
        except StoreError as exc:                    # Redis may come up later: the store still opens
            logger.warning("redis store at %s is unreachable for now (%s)", self.address, exc)

    @staticmethod
    def _key(key: bytes) -> str:
        return REDIS_PREFIX + key.hex()

    def _call(self, fn: Callable[..., T], *args: object, failed_reads: int = 0) -> T:
        """fn(*args) behind the breaker; connection trouble opens it."""
        with _guard(self._counters, self._closed, failed_reads):
            self._breaker.admit()
            try:
                result = fn(*args)
            except (self._redis.ConnectionError, self._redis.TimeoutError, TimeoutError, ConnectionError):
                self._breaker.tripped()
                raise
            self._breaker.succeeded()
            return result

    def _pipeline(self, command: str, arguments: Sequence[tuple]) -> list:
        pipe = self._client.pipeline(transaction=False)
        for args in arguments:
            pipe.execute_command(command, *args)
        return pipe.execute()

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        counts = self._call(self._pipeline, "EXISTS", [(self._key(key),) for key in keys])
        return [bool(count) for count in counts]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        records = self._call(self._client.mget, [self._key(key) for key in keys], failed_reads=len(keys))
        found = [record for record in records if record is not None]
        self._counters.add(reads=len(keys), hits=len(found), misses=len(keys) - len(found),
                           bytes_read=sum(len(record) for record in found))
        return records

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if not items:
            return
        self._call(self._pipeline, "SET", [(self._key(key), record) for key, record in items])
        self._counters.add(writes=len(items), bytes_written=sum(len(record) for _, record in items))

    def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        removed = self._call(self._client.delete, *[self._key(key) for key in keys])
        self._counters.add(deletions=removed)

    def stats(self) -> StoreStats:
        return self._counters.snapshot()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):         # closing a dead connection must not raise either
            self._client.close()


def open_store(spec: str, path: str | None, capacity_bytes: int, timeout_s: float) -> Store | None:
    """The store named by `--store`: "none" (None), "disk" (at `path`, default <cache dir>/store),
    a redis://host:port/db URL, or a Redis Cluster's redis+cluster://host:port,host:port,..."""
    if spec == "none":
        return None
    if spec == "disk":
        return DiskStore(path or str(cache_dir() / "store"), capacity_bytes)
    if spec.startswith("redis://"):
        return RedisStore(spec, timeout_s)
    if spec.startswith("redis+cluster://"):
        from kvstrata.kvcache.redis_cluster import RedisClusterStore
        return RedisClusterStore(spec, timeout_s)
    raise ValueError(f"--store must be none, disk, a redis://host:port/db URL or a "
                     f"redis+cluster://host:port,... URL, not {spec!r}")
