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
import errno
import logging
import os
import stat
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvstrata.kvcache.stores.base import Counters, StoreStats, guard, refusal
from kvstrata.kvcache.stores.records import HEADER

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".kvr"
TEMP_PREFIX = ".tmp-"
STALE_TEMP_S = 300.0          # a temp file this old is a crashed writer's, not one in progress
SWEEP_TO = 0.9                # a sweep deletes down to this share of the budget (amortizes the scan)
SHARDS = tuple(f"{shard:02x}" for shard in range(256))
FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
SHARD = FOLDER | os.O_NOFOLLOW
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC    # a FIFO in a record's place never blocks
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


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

    The store never leaves its folder. The folder is opened as given (links followed: it is the user's
    path); everything under it is reached component by component through directory descriptors, never
    through a link: a shard with O_NOFOLLOW | O_DIRECTORY relative to the folder, a record with
    O_NOFOLLOW | O_NONBLOCK relative to its shard; a put's temp file is made and renamed relative to the
    shard's descriptor, so a shard swapped for a link cannot redirect it. A record is read only once
    fstat shows a regular file whose size is the length its header declares (`refusal`), and never
    beyond; its recency is set on the descriptor. Anything else in a record's place (a link, a FIFO, a
    folder, a file of another length) is a miss, counted as `refused`, logged by name, and removed
    (a folder left) as the engine removes a record that fails its checks; anything but a folder in a
    shard's place is a miss for reads and an error for puts, and a store will not open on it.

    Descriptors are opened per operation (the folder once a batch, a shard once a key), never kept: no
    descriptor is shared by threads, so nothing is closed under a running call; none is inherited by a
    fork or left open by a store never closed; and a folder removed while the engine runs (a user
    clearing the cache) is made again by the next put. The cost is an open and a close per key, a few
    microseconds against a record's read.

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
            with self._folder(create=True) as root:
                for shard in SHARDS:
                    with _shard(root, shard, create=True):
                        pass
            self._sweep()
        except OSError as exc:
            raise ValueError(f"cannot use {self.root} as a disk store: {exc}") from exc
        logger.info("disk store at %s: %.1f of %.1f GB used", self.root, self._usage / 1e9, capacity_bytes / 1e9)

    @contextlib.contextmanager
    def _folder(self, create: bool = False) -> Iterator[int | None]:
        """The store's folder opened for one operation; None if it is gone (made again if `create`)."""
        try:
            fd: int | None = os.open(self.root, FOLDER)
        except FileNotFoundError:
            if create:
                self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root, FOLDER) if create else None
        with _closing(fd):
            yield fd

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with guard(self._counters, self._closed), self._folder() as root:
            return [root is not None and _is_file(root, key) for key in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with guard(self._counters, self._closed, failed_reads=len(keys)), self._folder() as root:
            records = [None if root is None else self._read(root, key) for key in keys]
        found = [record for record in records if record is not None]
        self._counters.add(reads=len(keys), hits=len(found), misses=len(keys) - len(found),
                           bytes_read=sum(len(record) for record in found))
        return records

    def _read(self, root: int, key: bytes) -> bytes | None:
        name = _record_name(key)
        with _shard(root, key[:1].hex()) as shard:
            if shard is None:
                return None
            info = None
            try:
                fd = os.open(name, READ, dir_fd=shard)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENXIO):     # a link; a socket
                    raise
                reason = "not a file"
            else:
                try:
                    info = os.fstat(fd)
                    reason = (refusal(os.pread(fd, HEADER.size, 0), info.st_size) if stat.S_ISREG(info.st_mode)
                              else "not a file")
                    if reason is None:
                        record = _read_exactly(fd, info.st_size)
                        if record is not None:
                            os.utime(fd)
                        return record
                finally:
                    os.close(fd)
            self._refuse(shard, name, reason, info)
            return None

    def _refuse(self, shard: int, name: str, reason: str, seen: os.stat_result | None) -> None:
        """Count a value that is no record of its length as refused, log its name (never its bytes), and
        remove it, unless it is a folder or was replaced since `seen` (None: the link now there)."""
        logger.warning("disk store: refused %s (%s), a miss", name, reason)
        self._counters.add(refused=1)
        with contextlib.suppress(OSError):
            seen = seen or os.stat(name, dir_fd=shard, follow_symlinks=False)
            if not stat.S_ISDIR(seen.st_mode):
                self._freed(_unlink(shard, name, seen))

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        with guard(self._counters, self._closed), self._folder(create=True) as root:
            for key, record in items:
                self._write(root, key, record)
                self._counters.add(writes=1, bytes_written=len(record))
                with self._usage_lock:
                    self._usage += len(record)
                    self._written += len(record)
                    over = self._usage > self.capacity_bytes
                if over:
                    with self._sweep_lock:          # one sweep at a time; puts over the budget wait for it
                        if self._usage > self.capacity_bytes:      # unless the sweep we waited for did it
                            self._sweep()

    @staticmethod
    def _write(root: int, key: bytes, record: bytes) -> None:
        with _shard(root, key[:1].hex(), create=True) as shard:
            temp = f"{TEMP_PREFIX}{os.urandom(8).hex()}"
            fd = os.open(temp, CREATE, 0o600, dir_fd=shard)
            try:
                with open(fd, "wb") as f:
                    f.write(record)
                os.replace(temp, _record_name(key), src_dir_fd=shard, dst_dir_fd=shard)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=shard)
                raise

    def delete(self, keys: Sequence[bytes]) -> None:
        with guard(self._counters, self._closed), self._folder() as root:
            if root is None:
                return
            for key in keys:
                with _shard(root, key[:1].hex()) as shard:
                    freed = None if shard is None else _unlink(shard, _record_name(key))
                if freed is not None:
                    self._counters.add(deletions=1)
                    self._freed(freed)

    def _freed(self, size: int | None) -> None:
        if size is not None:
            with self._usage_lock:
                self._usage -= size

    def _sweep(self) -> None:
        """Learn the folder's true size, delete least recently read records down to SWEEP_TO of the
        budget, remove temp files of crashed writers."""
        with self._usage_lock:
            written_before = self._written
        now = time.time()
        records: list[tuple[float, int, str, str]] = []           # (mtime, size, shard, name)
        total = evicted = 0
        with self._folder() as root:
            for shard_name in SHARDS if root is not None else ():
                with _shard(root, shard_name) as shard:
                    total += 0 if shard is None else self._scan(shard, shard_name, now, records)
            if total > self.capacity_bytes:
                target = int(self.capacity_bytes * SWEEP_TO)
                victims: defaultdict[str, list[str]] = defaultdict(list)
                for _, size, shard_name, name in sorted(records):
                    if total <= target:
                        break
                    victims[shard_name].append(name)
                    total -= size
                    evicted += 1
                for shard_name, names in victims.items():
                    with _shard(root, shard_name) as shard:
                        for name in names if shard is not None else ():
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(name, dir_fd=shard)
                logger.debug("disk store sweep evicted %d records", evicted)
        self._counters.add(evictions=evicted)
        with self._usage_lock:
            self._usage = total + self._written - written_before

    @staticmethod
    def _scan(shard: int, shard_name: str, now: float, records: list[tuple[float, int, str, str]]) -> int:
        """Bytes of one shard's records and temp files in progress; its records appended to `records`,
        its stale temp files removed."""
        total = 0
        with os.scandir(shard) as entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:                      # removed by another engine meanwhile
                    continue
                if stat.S_ISDIR(info.st_mode):
                    continue
                if entry.name.endswith(RECORD_SUFFIX):
                    records.append((info.st_mtime, info.st_size, shard_name, entry.name))
                    total += info.st_size
                elif entry.name.startswith(TEMP_PREFIX):
                    if now - info.st_mtime > STALE_TEMP_S:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.name, dir_fd=shard)
                        logger.info("removed a crashed writer's temp file %s/%s", shard_name, entry.name)
                    else:
                        total += info.st_size
        return total

    def stats(self) -> StoreStats:
        return self._counters.snapshot()

    def close(self) -> None:
        self._closed = True


def _record_name(key: bytes) -> str:
    return f"{key.hex()}{RECORD_SUFFIX}"


@contextlib.contextmanager
def _shard(root: int, name: str, create: bool = False) -> Iterator[int | None]:
    """Shard `name` of the folder `root` opened as a folder, never through a link; None if it is missing or
    something else is in its place. With `create`, a missing shard is made and anything else is an error."""
    try:
        fd: int | None = os.open(name, SHARD, dir_fd=root)
    except FileNotFoundError:
        if create:
            with contextlib.suppress(FileExistsError):         # made meanwhile by another engine
                os.mkdir(name, dir_fd=root)
        fd = os.open(name, SHARD, dir_fd=root) if create else None
    except OSError as exc:
        if create or exc.errno not in (errno.ELOOP, errno.ENOTDIR):     # a link, a file
            raise
        fd = None
    with _closing(fd):
        yield fd


@contextlib.contextmanager
def _closing(fd: int | None) -> Iterator[None]:
    """Close `fd` (if any) when the block ends, however it ends: no descriptor outlives its operation."""
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _is_file(root: int, key: bytes) -> bool:
    """Whether `key`'s record is a regular file (not read: `get` checks its length)."""
    with _shard(root, key[:1].hex()) as shard:
        try:
            return shard is not None and stat.S_ISREG(
                os.stat(_record_name(key), dir_fd=shard, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False


def _read_exactly(fd: int, size: int) -> bytes | None:
    """The file's first `size` bytes, never more; None if it is shorter (truncated in place meanwhile)."""
    chunks = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _unlink(shard: int, name: str, seen: os.stat_result | None = None) -> int | None:
    """Bytes freed by removing `name` from `shard`; None if it was gone, or replaced since `seen`."""
    try:
        info = os.stat(name, dir_fd=shard, follow_symlinks=False)
        if seen is not None and (info.st_dev, info.st_ino) != (seen.st_dev, seen.st_ino):
            return None                     # another engine's put replaced it: a record, keep it
        os.unlink(name, dir_fd=shard)
    except FileNotFoundError:
        return None
    return info.st_size
