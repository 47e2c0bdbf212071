"""`RedisStore`: records in a Redis database shared by engines (`--store redis://host:port/db`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

from kvstrata.kvcache.stores.base import REDIS_PREFIX, Breaker, Counters, StoreError, StoreStats, guard
from kvstrata.kvcache.stores.redis_reads import Command, checked, grouped, plan, probe, value

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RedisStore:
    """Records in a Redis database shared by engines, under `kvstrata:<hash hex>`.

    Capacity is Redis's: run it with a memory limit and LRU eviction, e.g.
    `redis-server --maxmemory 20gb --maxmemory-policy allkeys-lru`; with the default `noeviction`
    policy a full Redis refuses puts (StoreError("full")) while keeping old records forever.

    Each batch is one round trip (a pipeline of EXISTS or SET, one DEL), a get two: a value is read only
    once it is a record of its length, and no further (kvstrata.kvcache.stores.redis_reads). Timeouts bound every
    socket wait, and nothing is retried: after a connection failure or a timeout the breaker makes
    calls fail fast for a second, then lets one through. A Redis restart between calls costs nothing:
    redis-py replaces a pooled connection the server closed when it hands it out. The redis-py
    client and its connection pool are thread-safe.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"a store timeout must be positive, not {timeout_s}")
        import redis  # here, so a server without Redis never pays for the import
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        parts = urlsplit(url)
        self.address = f"{parts.hostname}:{parts.port or 6379}{parts.path}"     # for logs: no password
        self._redis = redis
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0))          # not redis-py's 3 backed-off retries: the breaker decides
        self._counters = Counters()
        self._breaker = Breaker()
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
        with guard(self._counters, self._closed, failed_reads):
            self._breaker.admit()
            try:
                result = fn(*args)
            except (self._redis.ConnectionError, self._redis.TimeoutError, TimeoutError, ConnectionError):
                self._breaker.tripped()
                raise
            self._breaker.succeeded()
            return result

    def _pipeline(self, commands: Sequence[Sequence[Command]]) -> list[list]:
        """Each key's commands in one pipeline; each key's replies."""
        pipe = self._client.pipeline(transaction=False)
        for each in commands:
            for command in each:
                pipe.execute_command(*command)
        return grouped(checked(pipe.execute(raise_on_error=False)), commands)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        counts = self._call(self._pipeline, [[("EXISTS", self._key(key))] for key in keys])
        return [bool(count) for count, in counts]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        names = [self._key(key) for key in keys]
        probes = self._call(self._pipeline, [probe(name) for name in names], failed_reads=len(keys))
        reads = [plan(name, replies) for name, replies in zip(names, probes)]
        bodies = self._call(self._pipeline, [read.commands for read in reads], failed_reads=len(keys))
        records = [value(read, replies) for read, replies in zip(reads, bodies)]
        found = [record for record in records if record is not None]
        self._counters.add(reads=len(keys), hits=len(found), misses=len(keys) - len(found),
                           bytes_read=sum(len(record) for record in found), refused=sum(r.refused for r in reads))
        return records

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if not items:
            return
        self._call(self._pipeline, [[("SET", self._key(key), record)] for key, record in items])
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
