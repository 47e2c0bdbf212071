"""The store tier: block hash -> one checksummed record, below host memory.

    base.py           the `Store` protocol, `StoreError`, counters and the circuit breaker they share
    disk.py           `DiskStore`, the embedded default: a file per block, a byte budget, LRU deletion
    redis_store.py    `RedisStore`, for engines sharing a cache
    redis_cluster.py  `RedisClusterStore`, the same over a Redis Cluster
    redis_reads.py    the get both Redis stores share: a value read only once it is a record of its length
    records.py        the record format (header, token ids, checksum; never pickle)
"""

from __future__ import annotations

from kvstrata.core.config import cache_dir
from kvstrata.kvcache.stores.base import Store
from kvstrata.kvcache.stores.disk import DiskStore
from kvstrata.kvcache.stores.redis_cluster import RedisClusterStore
from kvstrata.kvcache.stores.redis_store import RedisStore


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
        return RedisClusterStore(spec, timeout_s)
    raise ValueError(f"--store must be none, disk, a redis://host:port/db URL or a "
                     f"redis+cluster://host:port,... URL, not {spec!r}")
