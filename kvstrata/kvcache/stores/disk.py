"""`DiskStore`: the embedded default store, one file per block under a folder, a byte budget with LRU deletion.

A file per block rather than segments: gets, the path a request waits on, are as fast either way
(`benchmarks/disk_layout.py`), and files give for free what segments would have to build:
deleting one block (LRU), two engines on one folder without a shared index or locks, nothing to
recover after a crash (atomic os.replace, unlink). Segments put faster where creating a file is
dear; puts run off the step loop. Figures: docs/design/tiers-and-stores.md. Callers should check `exists`
before encoding a block to put: a rewrite costs a create.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kvstrata.kvcache.stores.base import Counters, StoreStats, guard

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".kvr"
TEMP_PREFIX = ".tmp-"
STALE_TEMP_S = 300.0          # a temp file this old is a crashed writer's, not one in progress
SWEEP_TO = 0.9                # a sweep deletes down to this share of the budget (amortizes the scan)


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
        self._counters = Counters()
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
        with guard(self._counters, self._closed):
            return [self._path(key).is_file() for key in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with guard(self._counters, self._closed, failed_reads=len(keys)):
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
        with guard(self._counters, self._closed):
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
        with guard(self._counters, self._closed):
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
