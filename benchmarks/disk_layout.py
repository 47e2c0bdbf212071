"""Which on-disk layout for the disk store: one file per block, or append-only segments with an index?

    .venv/bin/python benchmarks/disk_layout.py                    # 500 records of 0.74 MB, 2 rounds, < 1 min
    .venv/bin/python benchmarks/disk_layout.py --records 200 --rounds 1 --dir /mnt/nvme/tmp

Three layouts, each putting then getting the same seeded records in batches of 16 (one request's
blocks), in interleaved rounds (a shared machine is noisy); each figure is the median over rounds:
* `files`     one file per block in 256 dirs by hash prefix: temp file + os.replace; get = open/read + utime
* `segments`  append-only 64 MiB segment files plus an append-only index file; get = one pread
              (best case for segments: no compaction, no cross-process locking, index kept in memory)
* `DiskStore` the shipped store (kvstrata.kvcache.stores.disk): one file per block, budget accounting on

`put` is the time to hand every record to the page cache (the store never fsyncs: it is a cache, and
a record torn by a power loss fails its checksum); `put+sync` adds one os.sync() after it: the
sustained rate, once dirty pages must reach the disk (and the next layout starts with none).
Gets run twice, in shuffled order: warm (page cache) and cold (each file first dropped from the page
cache with posix_fadvise(DONTNEED), which touches only our own files).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import xxhash

from kvstrata.kvcache.buffers import KVCacheSpec
from kvstrata.kvcache.stores.disk import DiskStore
from kvstrata.kvcache.stores.records import encode_record, record_size

# One fp32 block of the default model (SmolLM2-135M: 30 layers, 3 kv heads, head dim 64), 16 tokens.
SPEC = KVCacheSpec(30, 3, 64, 16, torch.float32)
RECORD_BYTES = record_size(SPEC)
BATCH = 16
SEGMENT_BYTES = 64 * 1024 * 1024
INDEX_ENTRY = struct.Struct("<16sIQQ")            # key, segment, offset, length


class FilesLayout:
    """One file per block, sharded by the first hash byte."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for shard in range(256):
            (root / f"{shard:02x}").mkdir(parents=True, exist_ok=True)

    def _path(self, key: bytes) -> Path:
        return self.root / key[:1].hex() / f"{key.hex()}.kvr"

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for key, value in items:
            path = self._path(key)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with open(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, path)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            with open(path, "rb") as f:
                out.append(f.read())
            os.utime(path)
        return out

    def files(self) -> list[Path]:
        return list(self.root.glob("*/*.kvr"))

    def close(self) -> None:
        pass


class SegmentLayout:
    """Append-only segments plus an append-only index log (what a log-structured store would do)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.index: dict[bytes, tuple[int, int, int]] = {}
        self.index_fd = os.open(root / "index", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.read_fds: dict[int, int] = {}
        self.segment = -1
        self.offset = SEGMENT_BYTES
        self.write_fd = -1

    def _roll(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
        self.segment += 1
        self.offset = 0
        self.write_fd = os.open(self.root / f"{self.segment:08d}.seg",
                                os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        entries = []
        for key, value in items:
            if self.offset + len(value) > SEGMENT_BYTES:
                self._roll()
            os.write(self.write_fd, value)
            self.index[key] = (self.segment, self.offset, len(value))
            entries.append(INDEX_ENTRY.pack(key, self.segment, self.offset, len(value)))
            self.offset += len(value)
        os.write(self.index_fd, b"".join(entries))

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            segment, offset, length = self.index[key]
            fd = self.read_fds.get(segment)
            if fd is None:
                fd = self.read_fds[segment] = os.open(self.root / f"{segment:08d}.seg", os.O_RDONLY)
            out.append(os.pread(fd, length, offset))
        return out

    def files(self) -> list[Path]:
        return list(self.root.glob("*.seg"))

    def close(self) -> None:
        for fd in (self.index_fd, self.write_fd, *self.read_fds.values()):
            if fd >= 0:
                os.close(fd)


class ShippedStore:
    """The real DiskStore, with a budget large enough that nothing is deleted."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = DiskStore(str(root), capacity_bytes=1 << 40)
        self.put = self.store.put
        self.get = self.store.get
        self.close = self.store.close

    def files(self) -> list[Path]:
        return list(self.root.glob("*/*.kvr"))


def drop_from_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(layout, keys: list[bytes], payloads: list[bytes], seed: int) -> dict[str, float]:
    """Seconds to put every record (to the page cache, then synced), then get them all warm and cold."""
    items = list(zip(keys, payloads))
    batches = [items[i:i + BATCH] for i in range(0, len(items), BATCH)]
    put_s = timed(lambda: [layout.put(batch) for batch in batches])
    synced_s = put_s + timed(os.sync)          # one sync for all files: no per-file fsync penalty for `files`

    order = keys[:]
    random.Random(seed).shuffle(order)
    key_batches = [order[i:i + BATCH] for i in range(0, len(order), BATCH)]

    def get_all() -> None:
        for batch in key_batches:
            got = layout.get(batch)
            assert all(value is not None and len(value) == RECORD_BYTES for value in got)

    warm_s = timed(get_all)
    drop_from_page_cache(layout.files())
    cold_s = timed(get_all)
    return {"put": put_s, "put+sync": synced_s, "get warm": warm_s, "get cold": cold_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=500)
    parser.add_argument("--dir", default=None, help="parent folder for the scratch stores (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    base = rng.randbytes(SPEC.bytes_per_block)
    keys = [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(args.records)]
    # distinct records, generated once: records, since the DiskStore reads nothing else
    payloads = [encode_record(SPEC, "disk_layout", key, list(range(16)), key + base[16:]) for key in keys]
    print(f"{args.records} records of {RECORD_BYTES / 1e6:.2f} MB, batches of {BATCH}, "
          f"median of {args.rounds} rounds")
    layouts = {"files": FilesLayout, "segments": SegmentLayout, "DiskStore": ShippedStore}
    seconds: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
    for round_ in range(args.rounds):
        names = list(layouts)
        names = names[round_ % len(names):] + names[:round_ % len(names)]    # rotate who goes first
        for name in names:
            scratch = Path(tempfile.mkdtemp(prefix="kvstrata-layout-", dir=args.dir))
            layout = layouts[name](scratch / "store")
            try:
                seconds[name].append(run(layout, keys, payloads, args.seed + round_))
            finally:
                layout.close()
                shutil.rmtree(scratch)
    total_mb = args.records * RECORD_BYTES / 1e6
    for name, rounds in seconds.items():
        for label in rounds[0]:
            median = statistics.median(r[label] for r in rounds)
            print(f"{name:<10} {label:<9} {total_mb / median:8.0f} MB/s {args.records / median:8.0f} ops/s")


if __name__ == "__main__":
    main()
